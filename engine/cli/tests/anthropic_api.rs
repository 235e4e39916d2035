//! Anthropic's Messages API over real HTTP: the same conversation through `/v1/messages`
//! and `/v1/chat/completions` renders the same prompt and gives the same greedy reply;
//! tool use and tool results round-trip; the stream is Anthropic's event sequence; stop
//! sequences, usage and bad requests come back as Anthropic clients expect; and the
//! official Python SDK (`anthropic`, installed by `.ci/setup`) creates, streams and counts.
mod common;

use common::server::Server;
use common::{named_events, post, post_text, run_python_client};
use serde_json::{json, Value};

async fn messages(server: &Server, body: Value) -> (u16, Value) {
    post(
        &format!("{}/v1/messages", server.url),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_answers_as_the_same_chat_completion_does() {
    let server = Server::start(&[]);
    // Long enough for whole 64-token pages, so the second request hits the prefix cache.
    let system = "You are a terse assistant for a coding agent. ".repeat(8);
    let (status, c) = chat(
        &server,
        json!({"max_tokens": 12, "temperature": 0, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Write a haiku about caches."}]}),
    )
    .await;
    assert_eq!(status, 200, "{c}");
    let (status, m) = messages(
        &server,
        json!({"model": "kiln-tiny-random", "max_tokens": 12, "temperature": 0,
               "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
               "messages": [{"role": "user", "content": "Write a haiku about caches."}],
               "metadata": {"user_id": "u1"}}),
    )
    .await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert!(m["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(m["content"][0]["type"], "text");
    assert_eq!(
        m["content"][0]["text"],
        c["choices"][0]["message"]["content"]
    );
    let stop = match c["choices"][0]["finish_reason"].as_str().unwrap() {
        "length" => "max_tokens",
        _ => "end_turn",
    };
    assert_eq!(m["stop_reason"], stop);
    let u = &m["usage"];
    assert_eq!(
        u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
        c["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(u["output_tokens"], c["usage"]["completion_tokens"]);
    assert!(
        u["cache_read_input_tokens"].as_u64().unwrap() > 0,
        "the second identical prompt hits the cache: {u}"
    );
}

/// A tool use and its result render as the chat endpoint's tool call and tool message:
/// `count_tokens` gives the chat request's prompt length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_use_and_results_render_as_chat_tool_calls() {
    let server = Server::start(&[]);
    let id = "functions.read_file:0";
    let anthropic = json!({
        "model": "kiln-tiny-random",
        "tools": [{"name": "read_file", "description": "Read a file.",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "What is in a.py?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": id, "name": "read_file", "input": {"path": "a.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id,
                 "content": [{"type": "text", "text": "print('hi')"}]},
                {"type": "text", "text": "Explain it."}]}]});
    let (status, counted) = post(
        &format!("{}/v1/messages/count_tokens", server.url),
        anthropic.to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{counted}");
    let (status, c) = chat(
        &server,
        json!({"max_tokens": 1, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
            "messages": [
                {"role": "user", "content": "What is in a.py?"},
                {"role": "assistant", "content": "Reading it.", "tool_calls": [
                    {"id": id, "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\":\"a.py\"}"}}]},
                {"role": "tool", "tool_call_id": id, "content": "print('hi')"},
                {"role": "user", "content": "Explain it."}]}),
    )
    .await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(counted["input_tokens"], c["usage"]["prompt_tokens"]);
    let mut with_tools = anthropic.clone();
    with_tools["max_tokens"] = json!(8);
    with_tools["tool_choice"] = json!({"type": "auto"});
    let (status, m) = messages(&server, with_tools).await;
    assert_eq!(status, 200, "{m}");
    // A forced call (`any`, a named tool) is served; a choice of an undeclared tool is
    // refused, naming it.
    for (choice, status_wanted) in [
        (json!({"type": "any"}), 200),
        (json!({"type": "tool", "name": "read_file"}), 200),
        (json!({"type": "tool", "name": "write_file"}), 400),
    ] {
        let mut ask = anthropic.clone();
        ask["max_tokens"] = json!(8);
        ask["tool_choice"] = choice.clone();
        let (status, body) = messages(&server, ask).await;
        assert_eq!(status, status_wanted, "{choice}: {body}");
        if status == 400 {
            assert!(body.to_string().contains("tool_choice"), "{body}");
        }
    }
}

/// The stream: `message_start`, a text block whose deltas are the whole reply's text,
/// `message_delta` with the stop reason and usage, `message_stop`; no `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_is_anthropics_event_sequence() {
    let server = Server::start(&[]);
    let body = json!({"max_tokens": 10, "temperature": 0,
        "messages": [{"role": "user", "content": "Count to five."}]});
    let (_, whole) = messages(&server, body.clone()).await;
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let text = post_text(&format!("{}/v1/messages", server.url), &streamed).await;
    let (names, events): (Vec<String>, Vec<Value>) = named_events(&text).into_iter().unzip();
    for (name, data) in names.iter().zip(&events) {
        assert_eq!(data["type"], name.as_str(), "an event's name is its type");
    }
    assert!(!text.contains("[DONE]"));
    assert_eq!(names[0], "message_start");
    assert_eq!(names[1], "content_block_start");
    assert_eq!(names[names.len() - 2], "message_delta");
    assert_eq!(names[names.len() - 1], "message_stop");
    let deltas: String = (events.iter())
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| e["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, whole["content"][0]["text"].as_str().unwrap());
    let end = &events[events.len() - 2];
    assert_eq!(end["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(
        end["usage"]["output_tokens"],
        whole["usage"]["output_tokens"]
    );
}

/// A stop sequence ends the reply before it, with `stop_reason: stop_sequence`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sequence_is_named_in_the_reply() {
    let server = Server::start(&[]);
    let body = json!({"max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "Say something."}]});
    let (_, whole) = messages(&server, body.clone()).await;
    let full = whole["content"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "a reply long enough to cut: {full:?}");
    let stop: String = chars[4..7].iter().collect();
    let mut cut = body;
    cut["stop_sequences"] = json!([stop]);
    let (status, m) = messages(&server, cut).await;
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["stop_reason"], "stop_sequence");
    assert_eq!(m["stop_sequence"], stop.as_str());
    let before = &full[..full.find(&stop).unwrap()];
    assert_eq!(m["content"][0]["text"], before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_server_cannot_honour_are_refused_naming_the_field() {
    let server = Server::start(&[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, says) in [
        (json!({"messages": user}), "max_tokens"),
        (
            json!({"max_tokens": 4, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            "thinking",
        ),
        (
            json!({"max_tokens": 4, "messages": user, "top_k": -2}),
            "top_k",
        ),
        (
            json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            "messages[0].content",
        ),
        (json!({"max_tokens": 4, "messages": []}), "messages"),
    ] {
        let (status, reply) = messages(&server, body.clone()).await;
        assert_eq!(status, 400, "{body}: {reply}");
        assert!(reply.to_string().contains(says), "{body}: {reply}");
    }
    let disabled = json!({"max_tokens": 2, "messages": user, "thinking": {"type": "disabled"}});
    assert_eq!(messages(&server, disabled).await.0, 200);
}

/// Anthropic's own client: `messages.create`, `messages.stream` and `count_tokens` parse
/// what the server sends (the SDK validates every event and field it reads).
#[test]
fn the_official_python_sdk_creates_streams_and_counts() {
    let server = Server::start(&[]);
    let script = r#"
import sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0)
ask = [{"role": "user", "content": "Write a haiku about caches."}]
m = c.messages.create(model="kiln-tiny-random", max_tokens=8, system="Be terse.", messages=ask)
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens"), m
assert m.usage.output_tokens == 8 or m.stop_reason == "end_turn", m.usage
with c.messages.stream(model="kiln-tiny-random", max_tokens=8, system="Be terse.", messages=ask) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert final.stop_reason == m.stop_reason, final
assert final.usage.output_tokens == m.usage.output_tokens, final.usage
n = c.messages.count_tokens(model="kiln-tiny-random", system="Be terse.", messages=ask)
assert n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens, (n, m.usage)
print("ok", len(text))
"#;
    run_python_client(script, &server.url, "anthropic", "anthropic==2.17.0");
}

/// A server started with `--api-key` takes the key as Anthropic's clients send it
/// (`x-api-key`), and refuses a wrong one with 401.
#[test]
fn the_official_python_sdk_authenticates_with_its_own_header() {
    let server = Server::start(&["--api-key", "sesame"]);
    let script = r#"
import sys, anthropic
ask = dict(model="kiln-tiny-random", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
m = anthropic.Anthropic(base_url=sys.argv[1], api_key="sesame", max_retries=0).messages.create(**ask)
assert m.type == "message", m
try:
    anthropic.Anthropic(base_url=sys.argv[1], api_key="wrong", max_retries=0).messages.create(**ask)
    raise SystemExit("a wrong key was accepted")
except anthropic.AuthenticationError as e:
    assert e.status_code == 401, e
print("ok")
"#;
    run_python_client(script, &server.url, "anthropic", "anthropic==2.17.0");
}

/// A streamed `tool_use` block starts once the call's id is generated and its input
/// arrives as `input_json_delta` fragments that add up to the unstreamed reply's input:
/// kiln-coder asked what a function in a file does reads the file first (as trained);
/// read by Anthropic's Python client.
#[test]
fn streamed_tool_use_adds_up_to_the_whole_replys_input() {
    let server = Server::start(&["--model", "kiln-coder"]);
    let script = r#"
import sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0)
ask = dict(model="kiln-coder", max_tokens=48, extra_body={"temperature": 0},
           system="You are a coding agent. Read files before you answer.",
           messages=[{"role": "user", "content": "What does `dumps` in `json/__init__.py` do?"}],
           tools=[{"name": "read_file", "description": "Read a file of the repository.",
                   "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                                    "required": ["path"]}}])
m = c.messages.create(**ask)
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and uses, m
fragments = 0
with c.messages.stream(**ask) as s:
    for e in s:
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
            fragments += 1
    final = s.get_final_message()
streamed = [b for b in final.content if b.type == "tool_use"]
assert [(b.id, b.name, b.input) for b in streamed] == [(b.id, b.name, b.input) for b in uses], (streamed, uses)
assert final.stop_reason == "tool_use" and fragments > len(uses), (final.stop_reason, fragments)
print("ok", uses[0].input)
"#;
    run_python_client(script, &server.url, "anthropic", "anthropic==2.17.0");
}
