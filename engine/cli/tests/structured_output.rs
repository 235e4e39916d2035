//! Structured outputs over HTTP, asked for with OpenAI's own Python client: a JSON schema
//! as chat's `response_format` (whole, streamed, several seeds) and as the Responses API's
//! `text.format`, on the tiny random model, whose unconstrained output is noise. The
//! schema's documents are finitely many, so every reply must be one of them, complete.
mod common;

use common::server::Server;
use common::{post, run_python_client};
use serde_json::json;

#[test]
fn every_reply_is_a_document_of_the_schema() {
    let server = Server::start(&[]);
    let script = r#"
import itertools, json, sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
schema = {"type": "object", "additionalProperties": False, "required": ["ok", "lang"],
          "properties": {"ok": {"type": "boolean"}, "lang": {"enum": ["rust", "python"]}}}
docs = [{"ok": ok, "lang": lang} for ok, lang in itertools.product([True, False], ["rust", "python"])]
fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
ask = dict(model="kiln-tiny-random", messages=[{"role": "user", "content": "Is Rust fast?"}], max_tokens=48,
           response_format=fmt)
for seed in range(6):
    r = c.chat.completions.create(temperature=0 if seed == 0 else 1.0, seed=seed, **ask)
    ch = r.choices[0]
    assert ch.finish_reason == "stop", (seed, ch)
    assert json.loads(ch.message.content) in docs, (seed, ch.message.content)
streamed = "".join(e.choices[0].delta.content or "" for e in
                   c.chat.completions.create(stream=True, temperature=1.0, seed=3, **ask) if e.choices)
alone = c.chat.completions.create(temperature=1.0, seed=3, **ask).choices[0].message.content
assert streamed == alone, (streamed, alone)
obj = c.chat.completions.create(temperature=0, max_tokens=48, model="kiln-tiny-random",
    messages=[{"role": "user", "content": "hi"}], response_format={"type": "json_object"})
ch = obj.choices[0]
if ch.finish_reason == "stop":
    assert isinstance(json.loads(ch.message.content), dict), ch.message.content
else:
    assert ch.message.content.lstrip().startswith("{"), ch.message.content
r = c.responses.create(model="kiln-tiny-random", input="Is Rust fast?", max_output_tokens=48, temperature=0,
    text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
assert r.status == "completed", r
assert json.loads(r.output_text) in docs, r.output_text
print("ok")
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_or_schema_that_cannot_be_followed_is_refused_with_the_field_named() {
    let server = Server::start(&[]);
    let url = format!("{}/v1/chat/completions", server.url);
    for format in [
        json!({"type": "xml"}),
        json!({"type": "json_schema", "json_schema": {"name": "x"}}),
        json!({"type": "json_schema", "json_schema": {"schema": {"type": "object",
            "properties": {"a": {"$ref": "#/$defs/missing"}}}}}),
    ] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}],
                          "response_format": format});
        let (status, reply) = post(&url, body.to_string(), None).await;
        assert_eq!(status, 400, "{format}: {reply}");
        assert_eq!(reply["error"]["param"], "response_format", "{reply}");
    }
    let (status, _) = post(
        &url,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200, "the server still serves");
}

/// A constrained request's drafts are verified against its masked rows: with speculation
/// on (drafting at every step) it answers what it answers without, and follows its schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculation_leaves_a_constrained_reply_as_it_is() {
    let plain = Server::start(&[]);
    let spec = Server::start(&[
        "--speculative",
        "suffix",
        "--max-draft-tokens",
        "4",
        "--draft-policy",
        "fixed",
    ]);
    let schema = json!({"type": "object", "required": ["words"], "additionalProperties": false,
        "properties": {"words": {"type": "array", "maxItems": 3,
                                 "items": {"enum": ["alpha", "beta"]}}}});
    let body = json!({"messages": [{"role": "user", "content": "alpha beta alpha beta"}],
        "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}});
    let mut replies = Vec::new();
    for server in [&plain, &spec] {
        let url = format!("{}/v1/chat/completions", server.url);
        let (status, reply) = post(&url, body.to_string(), None).await;
        assert_eq!(status, 200, "{reply}");
        let content = reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let doc: serde_json::Value = serde_json::from_str(&content).expect("a JSON document");
        assert!(
            doc["words"].as_array().is_some_and(|w| w.len() <= 3),
            "{doc}"
        );
        replies.push(content);
    }
    assert_eq!(replies[0], replies[1]);
    let metrics = reqwest::get(format!("{}/metrics", spec.url)).await.unwrap();
    let metrics = metrics.text().await.unwrap();
    let drafted = (metrics.lines())
        .find_map(|l| l.strip_prefix("kiln_spec_drafted_tokens_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(drafted.is_some_and(|d| d > 0.0), "it drafted: {drafted:?}");
}
