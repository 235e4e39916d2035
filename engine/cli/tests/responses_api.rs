//! OpenAI's Responses API over real HTTP: a response answers as the same chat completion
//! does; function calls and their outputs render as chat tool calls; the stream is the
//! API's typed event sequence; what the server cannot honour is refused; and the official
//! Python SDK (`openai`, installed by `.ci/setup`) creates and streams responses.
mod common;

use common::server::Server;
use common::{named_events, post, post_text, run_python_client};
use serde_json::{json, Value};

async fn responses(server: &Server, body: Value) -> (u16, Value) {
    post(
        &format!("{}/v1/responses", server.url),
        body.to_string(),
        None,
    )
    .await
}

async fn chat(server: &Server, body: Value) -> (u16, Value) {
    post(
        &format!("{}/v1/chat/completions", server.url),
        body.to_string(),
        None,
    )
    .await
}

/// The text of a response's message item.
fn output_text(r: &Value) -> &str {
    r["output"][0]["content"][0]["text"].as_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_answers_as_the_same_chat_completion_does() {
    let server = Server::start(&[]);
    let (status, r) = responses(
        &server,
        json!({"model": "kiln-tiny-random", "instructions": "Be terse.", "input": "Name a cache.",
               "max_output_tokens": 10, "temperature": 0, "store": false}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let (status, c) = chat(
        &server,
        json!({"max_tokens": 10, "temperature": 0, "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Name a cache."}]}),
    )
    .await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(r["output"][0]["type"], "message");
    assert_eq!(output_text(&r), c["choices"][0]["message"]["content"]);
    let status = match c["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => "incomplete",
        _ => "completed",
    };
    assert_eq!(r["status"], status);
    assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    assert_eq!(r["usage"]["output_tokens"], c["usage"]["completion_tokens"]);
}

/// Function calls and their outputs as items render as the chat endpoint's tool calls and
/// tool messages: the same prompt length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_calls_and_outputs_render_as_chat_tool_calls() {
    let server = Server::start(&[]);
    let id = "functions.read_file:0";
    let (status, r) = responses(
        &server,
        json!({"max_output_tokens": 1, "temperature": 0,
            "tools": [{"type": "function", "name": "read_file", "description": "Read a file.",
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "input": [
                {"role": "developer", "content": "You are a coding agent."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is in a.py?"}]},
                {"type": "function_call", "call_id": id, "name": "read_file", "arguments": "{\"path\":\"a.py\"}"},
                {"type": "function_call_output", "call_id": id, "output": "print('hi')"},
                {"role": "user", "content": "Explain it."}]}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let (status, c) = chat(
        &server,
        json!({"max_tokens": 1, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "What is in a.py?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": id, "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\":\"a.py\"}"}}]},
                {"role": "tool", "tool_call_id": id, "content": "print('hi')"},
                {"role": "user", "content": "Explain it."}]}),
    )
    .await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"]);
    // tool_choice in the Responses API's shape: a declared function or "required" forces
    // a call, an undeclared one is refused, named.
    let tools =
        json!([{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]);
    for choice in [
        json!({"type": "function", "name": "read_file"}),
        json!("required"),
    ] {
        let body =
            json!({"input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": choice});
        assert_eq!(responses(&server, body).await.0, 200, "{choice}");
    }
    let undeclared = json!({"type": "function", "name": "write_file"});
    let body =
        json!({"input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": undeclared});
    let (status, reply) = responses(&server, body).await;
    assert_eq!(status, 400, "{reply}");
    assert!(reply.to_string().contains("write_file"), "{reply}");
    let auto =
        json!({"input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": "auto"});
    assert_eq!(responses(&server, auto).await.0, 200);
}

/// The stream: `response.created` first, text deltas that make the whole response's text,
/// `response.completed` (or `.incomplete`) last, sequence numbers in order, no `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_the_apis_event_sequence() {
    let server = Server::start(&[]);
    let body = json!({"input": "Count to five.", "max_output_tokens": 10, "temperature": 0});
    let (_, whole) = responses(&server, body.clone()).await;
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let text = post_text(&format!("{}/v1/responses", server.url), &streamed).await;
    let mut events = Vec::new();
    for (name, data) in named_events(&text) {
        assert_eq!(data["type"], name.as_str(), "an event's name is its type");
        events.push(data);
    }
    assert!(!text.contains("[DONE]"));
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    assert_eq!(events[0]["type"], "response.created");
    let last = events.last().unwrap();
    let end = match whole["status"].as_str().unwrap() {
        "incomplete" => "response.incomplete",
        _ => "response.completed",
    };
    assert_eq!(last["type"], end);
    let deltas: String = (events.iter())
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, output_text(&whole));
    assert_eq!(output_text(&last["response"]), output_text(&whole));
    assert_eq!(last["response"]["usage"], whole["usage"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_server_cannot_honour_is_refused_naming_the_field() {
    let server = Server::start(&[]);
    for (body, says) in [
        (
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"input": "hi", "reasoning": {"effort": "high"}}),
            "reasoning",
        ),
        (
            json!({"input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "hi", "text": {"format": {"type": "xml"}}}),
            "text.format",
        ),
        (
            json!({"input": "hi", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
    ] {
        let (status, reply) = responses(&server, body.clone()).await;
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(reply.to_string().contains(says), "{body}: {reply}");
    }
}

/// OpenAI's own client: `responses.create`, streamed and not, parses what the server sends.
#[test]
fn the_official_python_sdk_creates_and_streams_responses() {
    let server = Server::start(&[]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
r = c.responses.create(model="kiln-tiny-random", instructions="Be terse.", input="Name a cache.",
                       max_output_tokens=8, temperature=0)
assert r.object == "response" and r.output[0].type == "message", r
text = r.output_text
events = list(c.responses.create(model="kiln-tiny-random", instructions="Be terse.",
                                 input="Name a cache.", max_output_tokens=8, temperature=0,
                                 stream=True))
assert events[0].type == "response.created", events[0]
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert deltas == text, (deltas, text)
assert events[-1].response.usage.output_tokens == r.usage.output_tokens
print("ok", len(text))
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

/// A streamed function call is added as an output item once its id is generated, its
/// arguments arrive as deltas, and it adds up to the unstreamed response's call: kiln-coder
/// asked what a function in a file does reads the file first (as trained); read by OpenAI's
/// Python client.
#[test]
fn streamed_function_calls_add_up_to_the_whole_responses_calls() {
    let server = Server::start(&["--model", "kiln-coder"]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
ask = dict(model="kiln-coder", max_output_tokens=48, temperature=0,
           instructions="You are a coding agent. Read files before you answer.",
           input="What does `dumps` in `json/__init__.py` do?",
           tools=[{"type": "function", "name": "read_file", "description": "Read a file of the repository.",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}])
r = c.responses.create(**ask)
calls = [(i.call_id, i.name, i.arguments) for i in r.output if i.type == "function_call"]
assert calls, r.output
events = list(c.responses.create(stream=True, **ask))
deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
assert [(i.call_id, i.name, i.arguments) for i in done] == calls, (done, calls)
assert [i.call_id for i in added] == [c[0] for c in calls] and all(i.arguments == "" for i in added)
assert "".join(d.delta for d in deltas) == "".join(c[2] for c in calls) and len(deltas) > len(calls)
final = events[-1].response
assert [(i.call_id, i.name, i.arguments) for i in final.output if i.type == "function_call"] == calls
print("ok", calls)
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}
