//! Tool calls over HTTP with the embedded kiln-coder (which was trained to read a file
//! before answering questions about it), read by OpenAI's Python client: streamed calls
//! add up to the whole reply's, and a named `tool_choice` forces its call.
mod common;

use common::run_python_client;
use common::server::Server;

/// Streamed tool calls arrive as they generate (a header with the call's id and name, then
/// argument fragments) and add up to the calls of the same reply unstreamed: kiln-coder,
/// asked what a function in a file does with `read_file` on offer, reads the file first
/// (as it was trained to); read by OpenAI's Python client.
#[test]
fn streamed_tool_calls_add_up_to_the_whole_replys_calls() {
    let server = Server::start(&["--model", "kiln-coder"]);
    let script = r#"
import sys, json, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
ask = dict(model="kiln-coder", max_tokens=48, temperature=0, messages=[
    {"role": "system", "content": "You are a coding agent. Read files before you answer."},
    {"role": "user", "content": "What does `dumps` in `json/__init__.py` do?"}],
    tools=[{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}])
whole = c.chat.completions.create(**ask).choices[0]
assert whole.finish_reason == "tool_calls" and whole.message.tool_calls, whole
calls, chunks_with_calls, finish = {}, 0, None
for ch in c.chat.completions.create(stream=True, **ask):
    for choice in ch.choices:
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            chunks_with_calls += 1
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
assert finish == "tool_calls", finish
want = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls]
assert [calls[i] for i in sorted(calls)] == want, (calls, want)
assert chunks_with_calls > len(want), "arguments come in pieces"
json.loads(want[0]["arguments"])
print("ok", want)
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

/// `tool_choice` naming a function forces that call even where the model would answer in
/// text: kiln-coder asked for a function (it answers with code unforced) is made to call
/// `read_file`, with no text (its arguments are its own: this small model's may not end);
/// asked about a file, the forced call adds up streamed as whole. OpenAI's Python client.
#[test]
fn a_named_tool_choice_forces_the_call() {
    let server = Server::start(&["--model", "kiln-coder"]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
force = {"type": "function", "function": {"name": "read_file"}}
def ask(content, **more):
    return dict(model="kiln-coder", max_tokens=40, temperature=0, tools=tools,
                messages=[{"role": "user", "content": content}], **more)
def streamed(a):
    calls, text = {}, ""
    for ch in c.chat.completions.create(stream=True, **a):
        for choice in ch.choices:
            text += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
    return text, [calls[i] for i in sorted(calls)]
reverse = "Write a Python function that reverses a list."
free = c.chat.completions.create(**ask(reverse)).choices[0]
assert free.finish_reason != "tool_calls" and "def " in free.message.content, free
text, calls = streamed(ask(reverse, tool_choice=force))
assert text == "" and calls and calls[0]["id"] == "functions.read_file:0", (text, calls)
assert calls[0]["name"] == "read_file" and calls[0]["arguments"].startswith("{"), calls
about = ask("What does `dumps` in `json/__init__.py` do?", tool_choice=force)
about["messages"].insert(0, {"role": "system", "content": "You are a coding agent. Read files before you answer."})
whole = c.chat.completions.create(**about).choices[0]
want = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls]
assert whole.finish_reason == "tool_calls" and want[0]["name"] == "read_file", whole
assert streamed(about) == ("", want)
print("ok", want)
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}
