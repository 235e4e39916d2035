//! `kiln serve` end to end: a real server process (the embedded model on wgpu/llvmpipe in
//! CI), real HTTP, the `async-openai` client crate and concurrent clients.
mod common;

use std::time::{Duration, Instant};

use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestAssistantMessageArgs, ChatCompletionRequestMessage,
    ChatCompletionRequestSystemMessageArgs, ChatCompletionRequestUserMessageArgs,
    CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
};
use async_openai::Client;
use common::post;
use common::server::Server;
use futures_util::StreamExt;
use serde_json::{json, Value};

fn client(server: &Server, session: &str) -> Client<OpenAIConfig> {
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", server.url))
        .with_api_key("unused")
        .with_header("x-session-id", session)
        .expect("a valid header");
    Client::with_config(config)
}

fn system(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestSystemMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

fn assistant(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestAssistantMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

fn greedy(
    messages: Vec<ChatCompletionRequestMessage>,
    max_tokens: u32,
) -> CreateChatCompletionRequest {
    CreateChatCompletionRequestArgs::default()
        .messages(messages)
        .max_tokens(max_tokens)
        .temperature(0.0)
        .build()
        .unwrap()
}

/// A long shared system prompt, like a coding agent's tool-laden one.
fn agent_prompt() -> String {
    "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). ".repeat(24)
}

/// One agent session: `turns` requests, each re-sending the whole history plus a new user
/// message. Returns each turn's (request, reply, prompt tokens, cached tokens).
async fn session(
    server: &Server,
    id: usize,
    turns: usize,
) -> Vec<(CreateChatCompletionRequest, String, u32, u32)> {
    let c = client(server, &format!("session-{id}"));
    let mut history = vec![system(&agent_prompt())];
    let mut out = Vec::new();
    for turn in 0..turns {
        history.push(user(&format!(
            "Session {id}, step {turn}: fix the failing test."
        )));
        let req = greedy(history.clone(), 6);
        let resp = c.chat().create(req.clone()).await.expect("a completion");
        let usage = resp.usage.expect("usage");
        let cached = usage
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .expect("cached_tokens");
        let reply = resp.choices[0].message.content.clone().unwrap_or_default();
        history.push(assistant(&reply));
        out.push((req, reply, usage.prompt_tokens, cached));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_agent_sessions_hit_the_cache_and_match_running_alone() {
    let server = Server::start(&["--page-size", "16"]);
    let runs = futures_util::future::join_all((0..16).map(|i| session(&server, i, 5))).await;
    let (mut prompt, mut cached) = (0u64, 0u64);
    for turns in &runs {
        for (_, _, p, c) in &turns[1..] {
            prompt += *p as u64;
            cached += *c as u64;
        }
    }
    let hit_rate = cached as f64 / prompt as f64;
    assert!(
        hit_rate > 0.9,
        "cache hit rate after the first turn: {hit_rate:.3}"
    );
    let served = server.metric("kiln_cache_hit_rate");
    assert!(served > 0.5, "the server's own hit rate {served}");

    // The same requests one at a time on a fresh server: the same greedy replies.
    let alone = Server::start(&["--page-size", "16"]);
    let c = client(&alone, "alone");
    for turns in &runs {
        for (req, reply, _, _) in turns {
            let resp = c.chat().create(req.clone()).await.expect("a completion");
            let got = resp.choices[0].message.content.clone().unwrap_or_default();
            assert_eq!(&got, reply, "batched and alone replies differ");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_deltas_add_up_to_the_non_streamed_reply() {
    let server = Server::start(&[]);
    let c = client(&server, "stream");
    let req = greedy(vec![user("Write a haiku about kilns.")], 24);
    let whole = c.chat().create(req.clone()).await.unwrap();
    let whole = whole.choices[0].message.content.clone().unwrap_or_default();
    let mut stream = c.chat().create_stream(req).await.unwrap();
    let (mut text, mut finish) = (String::new(), None);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("a chunk");
        for choice in chunk.choices {
            text.push_str(choice.delta.content.as_deref().unwrap_or(""));
            finish = finish.or(choice.finish_reason);
        }
    }
    assert_eq!(text, whole);
    assert!(finish.is_some(), "the last chunk says why it finished");
}

/// Posts JSON (or raw bytes) and returns (status, body).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_right_4xx_and_the_server_keeps_serving() {
    let server = Server::start(&["--api-key", "sesame"]);
    let chat = format!("{}/v1/chat/completions", server.url);
    let completions = format!("{}/v1/completions", server.url);
    let key = Some("sesame");
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let long = "kiln ".repeat(5000);
    let cases: Vec<(&str, &str, Vec<u8>, Option<&str>, u16)> = vec![
        (
            "malformed JSON",
            &chat,
            b"{\"messages\": [".to_vec(),
            key,
            400,
        ),
        (
            "unknown model",
            &chat,
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})
                .to_string()
                .into_bytes(),
            key,
            404,
        ),
        (
            "prompt longer than the context",
            &completions,
            json!({"prompt": long, "max_tokens": 1})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
        (
            "negative max_tokens",
            &completions,
            json!({"prompt": "hi", "max_tokens": -1})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
        (
            "huge max_tokens",
            &completions,
            json!({"prompt": "hi", "max_tokens": 1u64 << 40})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
        (
            "invalid token ids",
            &completions,
            json!({"prompt": [1, 2, 100000]}).to_string().into_bytes(),
            key,
            400,
        ),
        ("a 10 MB body", &completions, vec![b' '; 10 << 20], key, 413),
        (
            "wrong API key",
            &chat,
            ok.to_string().into_bytes(),
            Some("open"),
            401,
        ),
        ("no API key", &chat, ok.to_string().into_bytes(), None, 401),
        (
            "unknown role",
            &chat,
            json!({"messages": [{"role": "wizard", "content": "hi"}]})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
        (
            "n = 17",
            &chat,
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 17})
                .to_string()
                .into_bytes(),
            key,
            400,
        ),
    ];
    for (what, url, body, k, want) in cases {
        let (status, body) = post(url, body, k).await;
        assert_eq!(status, want, "{what}: {body}");
        let message = body["error"]["message"].as_str().unwrap_or("");
        assert!(
            !message.is_empty(),
            "{what}: an OpenAI error with a message: {body}"
        );
    }
    let (status, body) = post(&chat, ok.to_string(), key).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_gives_its_kv_pages_back() {
    let server = Server::start(&[]);
    assert_eq!(server.metric("kiln_kv_usage"), 0.0);
    let body = json!({"prompt": "tell me everything", "max_tokens": 3000, "stream": true,
                      "ignore_eos": true});
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", server.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut chunks = resp.bytes_stream();
    for _ in 0..3 {
        chunks.next().await.expect("a chunk").expect("bytes");
    }
    assert!(
        server.metric("kiln_kv_usage") > 0.0,
        "the request holds pages"
    );
    drop(chunks);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (usage, running) = (
            server.metric("kiln_kv_usage"),
            server.metric("kiln_num_running_reqs"),
        );
        if usage == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KV usage stuck at {usage}, {running} running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(server.metric("kiln_requests_aborted_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_sessions_than_the_pool_holds_all_complete_through_preemption() {
    // 24 pages of 16 tokens: 384 tokens of KV for 12 requests of ~250 tokens each.
    let server = Server::start(&["--page-size", "16", "--kv-pages", "24"]);
    let url = format!("{}/generate", server.url);
    let requests = (0..12u32).map(|i| {
        let url = url.clone();
        async move {
            let ids: Vec<u32> = (0..150).map(|t| 20 + (t * 7 + i * 13) % 400).collect();
            let body = json!({"input_ids": ids,
                              "sampling_params": {"max_new_tokens": 100, "temperature": 0,
                                                  "ignore_eos": true}});
            post(&url, body.to_string(), None).await
        }
    });
    for (status, body) in futures_util::future::join_all(requests).await {
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["output_ids"].as_array().map(Vec::len), Some(100));
    }
    assert!(server.metric("kiln_preemptions_total") > 0.0);
    assert_eq!(server.metric("kiln_kv_usage"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_server_holds_a_thousand_concurrent_streams() {
    let server = Server::start(&["--max-running-requests", "256"]);
    let url = format!("{}/v1/completions", server.url);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let start = Instant::now();
    let streams = (0..1000u32).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = json!({"prompt": [3 + i % 400, 7, 9], "max_tokens": 4, "stream": true,
                              "ignore_eos": true, "temperature": 0});
            let resp = http.post(&url).json(&body).send().await?;
            let status = resp.status().as_u16();
            let text = resp.text().await?;
            Ok::<_, reqwest::Error>((status, text))
        }
    });
    let results = futures_util::future::join_all(streams).await;
    let elapsed = start.elapsed();
    for r in &results {
        let (status, text) = r.as_ref().expect("no connection error");
        assert_eq!(*status, 200, "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert_eq!(
            text.matches("\"finish_reason\":\"length\"").count(),
            1,
            "{text}"
        );
    }
    assert!(
        elapsed < Duration::from_secs(300),
        "1,000 streams took {elapsed:?}"
    );
    assert_eq!(server.metric("kiln_requests_finished_total"), 1000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_answers_503_and_serves_again_once_it_drains() {
    let server = Server::start(&["--max-running-requests", "1", "--max-queued-requests", "1"]);
    let url = format!("{}/v1/completions", server.url);
    let body = json!({"prompt": "busy", "max_tokens": 150, "ignore_eos": true}).to_string();
    let burst = (0..6).map(|_| post(&url, body.clone(), None));
    let results = futures_util::future::join_all(burst).await;
    let status = |code| results.iter().filter(|(s, _)| *s == code).count();
    assert_eq!(
        (status(200), status(503)),
        (2, 4),
        "one running, one waiting: {results:?}"
    );
    let (_, refused) = results.iter().find(|(s, _)| *s == 503).unwrap();
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("full"),
        "{refused}"
    );
    let (status, body) = post(
        &url,
        json!({"prompt": "again", "max_tokens": 2}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_seed_samples_the_same_completion() {
    let server = Server::start(&[]);
    let url = format!("{}/generate", server.url);
    let sample = |seed: u64| {
        let body = json!({"input_ids": [5, 6, 7, 8],
                          "sampling_params": {"max_new_tokens": 24, "temperature": 1.0,
                                              "top_p": 0.9, "seed": seed, "ignore_eos": true}});
        post(&url, body.to_string(), None)
    };
    let (a, b, c) = (sample(7).await, sample(7).await, sample(8).await);
    assert_eq!(a.1["output_ids"], b.1["output_ids"]);
    assert_ne!(
        a.1["output_ids"], c.1["output_ids"],
        "another seed, another sample"
    );
}

/// `--synthetic`: the tiny architecture as one rank of TP2 with every projection NVFP4 and
/// the all-reduces stood in for, served end to end on token ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synthetic_rank_serves_token_ids_end_to_end() {
    let server = Server::start(&["--synthetic", "tiny", "--tp-rank-of", "2", "--nvfp4-all"]);
    let (status, models) = {
        let resp = reqwest::get(format!("{}/v1/models", server.url))
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
    };
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "synthetic-tiny-tp2-rank-nvfp4");
    let body = json!({"input_ids": [5, 6, 7, 8], "stream": false,
                      "sampling_params": {"max_new_tokens": 12, "ignore_eos": true}});
    let (status, out) = post(&format!("{}/generate", server.url), body.to_string(), None).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["output_ids"].as_array().map(Vec::len),
        Some(12),
        "{out}"
    );
    // Ids index the rank's vocabulary slice (256 of the tiny model's 512, plus padding).
    assert!(out["output_ids"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t.as_u64().unwrap() < 257));
    assert!(server.log_text().contains("all-reduce stand-in calibrated"));
}

#[test]
fn impossible_speculation_flags_fail_at_start_up_with_the_flag_named() {
    for (args, says) in [
        (
            vec!["--speculative", "suffix", "--max-draft-tokens", "32"],
            "--max-draft-tokens must be 1 to 31",
        ),
        (
            vec!["--speculative", "ngram", "--max-draft-tokens", "0"],
            "--max-draft-tokens must be 1 to 31",
        ),
        (
            vec!["--simulated-accept-len", "2"],
            "--speculative simulate and --simulated-accept-len go together",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(&args)
            .output()
            .expect("kiln runs");
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn impossible_synthetic_cuts_fail_at_start_up_with_the_flag_named() {
    for (args, says) in [
        (
            vec!["--synthetic", "kimi-k2.6", "--layers", "0"],
            "--layers must be 1 to 61",
        ),
        (
            vec!["--synthetic", "tiny", "--tp-rank-of", "4"],
            "--tp-rank-of 4",
        ),
        (
            vec!["--synthetic", "tiny", "--tp-rank-of", "3"],
            "--tp-rank-of must be one of",
        ),
        (vec!["--layers", "2"], "--synthetic"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(&args)
            .output()
            .expect("kiln runs");
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
