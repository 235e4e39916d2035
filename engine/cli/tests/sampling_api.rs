//! Sampling over HTTP, read by OpenAI's own Python client: log-probabilities of chat (whole
//! and streamed), completions and `/generate` against the server's greedy choice; `n`
//! choices, each drawn as a lone request with the next seed; bad values refused.
mod common;

use common::server::Server;
use common::{post, run_python_client};
use serde_json::json;

#[test]
fn the_official_python_sdk_reads_logprobs_of_chat_and_completions() {
    let server = Server::start(&[]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
ask = dict(model="kiln-tiny-random", messages=[{"role": "user", "content": "Name a cache."}],
           max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
r = c.chat.completions.create(**ask)
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens > 0, (len(lp), r.usage)
for e in lp:
    tops = [t.logprob for t in e.top_logprobs]
    assert len(tops) == 3 and tops == sorted(tops, reverse=True), e
    # Greedy decoding emits the most likely token.
    assert e.token == e.top_logprobs[0].token and abs(e.logprob - tops[0]) < 1e-6, e
    assert e.logprob <= 0
    if "\ufffd" not in e.token:
        assert bytes(e.bytes) == e.token.encode(), e
streamed = [e for ch in c.chat.completions.create(stream=True, **ask)
            if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in lp]
plain = c.chat.completions.create(**{k: v for k, v in ask.items() if "logprobs" not in k})
assert plain.choices[0].logprobs is None
assert plain.choices[0].message.content == r.choices[0].message.content
comp = c.completions.create(model="kiln-tiny-random", prompt="Name a cache.", max_tokens=5,
                            temperature=0, logprobs=2)
L = comp.choices[0].logprobs
n = comp.usage.completion_tokens
assert len(L.tokens) == len(L.token_logprobs) == len(L.top_logprobs) == len(L.text_offset) == n
assert all(1 <= len(t) <= 2 for t in L.top_logprobs) and L.text_offset == sorted(L.text_offset)
print("ok", len(lp))
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

/// SGLang's `/generate`: `[logprob, id, null]` for each output id, alternatives most likely
/// first, the greedy choice the most likely; cumulative when streamed, the last chunk whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_returns_sglang_logprob_triples() {
    let server = Server::start(&[]);
    let url = format!("{}/generate", server.url);
    let ask = json!({"input_ids": [5, 6, 7], "return_logprob": true, "top_logprobs_num": 2,
                     "sampling_params": {"max_new_tokens": 5, "temperature": 0}});
    let (status, r) = post(&url, ask.to_string(), None).await;
    assert_eq!(status, 200, "{r}");
    let ids = r["output_ids"].as_array().unwrap();
    let tokens = r["meta_info"]["output_token_logprobs"].as_array().unwrap();
    let tops = r["meta_info"]["output_top_logprobs"].as_array().unwrap();
    assert!(
        !ids.is_empty() && tokens.len() == ids.len() && tops.len() == ids.len(),
        "{r}"
    );
    for ((id, t), top) in ids.iter().zip(tokens).zip(tops) {
        assert_eq!(&t[1], id);
        assert!(t[0].as_f64().unwrap() <= 0.0 && t[2].is_null());
        assert_eq!(top.as_array().unwrap().len(), 2);
        assert_eq!(&top[0][1], id, "greedy takes the most likely");
        assert!(top[0][0].as_f64() >= top[1][0].as_f64());
    }
    let mut stream = ask.clone();
    stream["stream"] = json!(true);
    let text = common::post_text(&url, &stream).await;
    let last: serde_json::Value = (text.lines())
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .last()
        .unwrap();
    assert_eq!(
        last["meta_info"]["output_token_logprobs"],
        r["meta_info"]["output_token_logprobs"]
    );
    let (_, plain) = post(&url, json!({"input_ids": [5, 6, 7]}).to_string(), None).await;
    assert!(
        plain["meta_info"].get("output_token_logprobs").is_none(),
        "{plain}"
    );
}

/// `n` choices: choice `i` is what a lone request seeded `seed + i` draws (sampling is keyed
/// by seed and position, not the batch), whole and streamed, chat and completions.
#[test]
fn n_choices_are_the_draws_of_the_following_seeds() {
    let server = Server::start(&[]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
ask = dict(model="kiln-tiny-random", messages=[{"role": "user", "content": "Name a cache."}],
           max_tokens=8, temperature=1.0, top_p=0.95)
r = c.chat.completions.create(n=3, seed=5, **ask)
assert [ch.index for ch in r.choices] == [0, 1, 2], r
texts = [ch.message.content for ch in r.choices]
for i in range(3):
    alone = c.chat.completions.create(seed=5 + i, **ask)
    assert alone.choices[0].message.content == texts[i], (i, texts, alone)
assert r.usage.prompt_tokens == alone.usage.prompt_tokens
assert r.usage.completion_tokens >= 3
parts = ["", "", ""]
for ch in c.chat.completions.create(n=3, seed=5, stream=True, **ask):
    for choice in ch.choices:
        parts[choice.index] += choice.delta.content or ""
assert parts == texts, (parts, texts)
comp = dict(model="kiln-tiny-random", prompt="Name a cache.", max_tokens=6, temperature=1.0)
whole = [ch.text for ch in c.completions.create(n=2, seed=9, **comp).choices]
streamed = ["", ""]
for ch in c.completions.create(n=2, seed=9, stream=True, **comp):
    for choice in ch.choices:
        streamed[choice.index] += choice.text
assert streamed == whole and whole[1] == c.completions.create(seed=10, **comp).choices[0].text
print("ok", texts)
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprob_requests_out_of_range_are_refused_with_the_field_named() {
    let server = Server::start(&[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    for (body, field) in [
        (
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"messages": user, "top_logprobs": 2}), "top_logprobs"),
        (json!({"messages": user, "logprobs": "yes"}), "logprobs"),
        (json!({"messages": user, "logprobs": 30}), "logprobs"),
    ] {
        let url = format!("{}/v1/chat/completions", server.url);
        let (status, reply) = post(&url, body.to_string(), None).await;
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["param"], field, "{body}: {reply}");
    }
}
