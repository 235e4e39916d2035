//! `kiln serve` under the faults a production server meets, each with its own process on
//! loopback and bounded waits: SIGTERM during streams (drained, none truncated), large
//! prompts tokenizing while `/health` is polled, a client that reads nothing, a model that
//! emits the tool-call marker when no tools were offered, and the error shape of every
//! refusal (405, 415, unknown fields, impossible tool choices, an empty API key).
mod common;

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use common::post;
use common::server::Server;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// The latency test runs alone (write), the others beside each other (read): on a 2-core
/// machine their servers' decoding would otherwise be what `/health` waits for.
static CPU: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    CPU.read().unwrap_or_else(|e| e.into_inner())
}

/// The `data:` payloads of a streamed response, read to its end; each first byte is
/// reported on `started`.
async fn read_stream(
    http: &reqwest::Client,
    url: &str,
    body: Value,
    started: Option<tokio::sync::mpsc::Sender<()>>,
) -> Vec<String> {
    let resp = http.post(url).json(&body).send().await.expect("sent");
    assert_eq!(resp.status(), 200);
    let mut bytes = resp.bytes_stream();
    let (mut text, mut started) = (String::new(), started);
    while let Some(chunk) = bytes.next().await {
        let chunk = chunk.expect("the stream is not cut");
        text.push_str(&String::from_utf8_lossy(&chunk));
        if let Some(tx) = started.take() {
            let _ = tx.send(()).await;
        }
    }
    text.split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect()
}

async fn get(url: &str) -> (u16, Value) {
    let resp = reqwest::get(url).await.expect("sent");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_lets_streams_finish_and_ends_the_rest_with_an_error_event() {
    let _cpu = shared();
    let mut server = Server::start(&["--shutdown-timeout", "4"]);
    let url = format!("{}/v1/completions", server.url);
    let http = reqwest::Client::new();
    let (tx, mut started) = tokio::sync::mpsc::channel(8);
    // Three short streams finish inside the timeout; three long ones cannot.
    let streams: Vec<_> = (0..6u32)
        .map(|i| {
            let (http, url, tx) = (http.clone(), url.clone(), tx.clone());
            let max_tokens = if i < 3 { 24 } else { 4000 };
            tokio::spawn(async move {
                let body = json!({"prompt": [5 + i, 6, 7], "max_tokens": max_tokens,
                                  "stream": true, "ignore_eos": true, "temperature": 0});
                read_stream(&http, &url, body, Some(tx)).await
            })
        })
        .collect();
    for _ in 0..6 {
        started.recv().await.expect("every stream starts");
    }
    server.terminate();
    // Draining: /health and new requests are 503 with the reason.
    let start = Instant::now();
    let health = loop {
        let (status, body) = get(&format!("{}/health", server.url)).await;
        if status == 503 || start.elapsed() > Duration::from_secs(5) {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(health.0, 503, "{}", health.1);
    assert_eq!(health.1["error"]["code"], "draining", "{}", health.1);
    let (status, refused) = post(
        &url,
        json!({"prompt": "late", "max_tokens": 2}).to_string(),
        None,
    )
    .await;
    assert_eq!(
        (status, &refused["error"]["code"]),
        (503, &json!("draining"))
    );

    for (i, stream) in streams.into_iter().enumerate() {
        let events = stream.await.expect("stream task");
        assert_eq!(
            events.last().map(String::as_str),
            Some("[DONE]"),
            "{events:?}"
        );
        let parsed: Vec<Value> = (events.iter().rev().skip(1))
            .map(|e| serde_json::from_str(e).expect("JSON events"))
            .collect();
        let finish = parsed[0]["choices"][0]["finish_reason"].clone();
        if i < 3 {
            assert_eq!(finish, "length", "stream {i} finished inside the timeout");
            assert!(parsed.iter().all(|e| e.get("error").is_none()));
        } else {
            assert_eq!(finish, "abort", "stream {i}: {events:?}");
            assert_eq!(parsed[1]["error"]["code"], "shutting_down", "{events:?}");
        }
    }
    let status = server
        .wait_exit(Duration::from_secs(20))
        .expect("the server exits");
    assert!(status.success(), "{status}");
    let log = server.log_text();
    assert!(log.contains("draining") && log.contains("drained"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_prompts_tokenize_off_the_runtime_while_health_answers_at_once() {
    let _cpu = CPU.write().unwrap_or_else(|e| e.into_inner());
    let server = Server::start(&[]);
    let url = format!("{}/v1/completions", server.url);
    let code = "fn main() { let x = vec![1, 2, 3]; println!(\"{x:?}\"); }\n";
    // Past what the context can hold in any tokenization: refused before tokenizing.
    let huge = code.repeat(7_500_000 / code.len());
    // Under that bound, so tokenized (on the blocking pool), then too long: 400 as well.
    let large = code.repeat(300_000 / code.len());
    let prompts = [huge.clone(), huge]
        .into_iter()
        .chain(std::iter::repeat_n(large, 6));
    let requests: Vec<_> = prompts
        .map(|p| {
            let url = url.clone();
            tokio::spawn(async move {
                post(
                    &url,
                    json!({"prompt": p, "max_tokens": 4}).to_string(),
                    None,
                )
                .await
            })
        })
        .collect();
    let http = reqwest::Client::new();
    let health = format!("{}/health", server.url);
    let mut latencies = Vec::new();
    while requests.iter().any(|r| !r.is_finished()) && latencies.len() < 3000 {
        let t = Instant::now();
        let status = http.get(&health).send().await.expect("health").status();
        latencies.push(t.elapsed());
        assert_eq!(status, 200);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for (i, r) in requests.into_iter().enumerate() {
        let (status, body) = r.await.expect("request task");
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["param"], "prompt", "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("maximum context length"), "{body}");
        // The huge ones by their size alone, the others once tokenized.
        let why = if i < 2 { "bytes" } else { "the prompt has" };
        assert!(message.contains(why), "{body}");
    }
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    assert!(latencies.len() >= 10, "{} health checks", latencies.len());
    assert!(
        p99 < Duration::from_millis(50),
        "health p99 {p99:?} over {latencies:?}"
    );
    // A small request is not held up either.
    let (status, body) = post(
        &url,
        json!({"prompt": "hi", "max_tokens": 2}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_pauses_its_request_then_is_aborted() {
    let _cpu = shared();
    let server = Server::start(&["--client-stall-timeout", "4"]);
    let host = server.url.strip_prefix("http://").unwrap().to_string();
    // SGLang-style events repeat the whole output, so unread bytes pile up fast.
    let body = json!({"input_ids": [5, 6, 7], "stream": true,
                      "sampling_params": {"max_new_tokens": 4000, "ignore_eos": true}})
    .to_string();
    let mut socket = std::net::TcpStream::connect(&host).expect("connect");
    write!(
        socket,
        "POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Read the headers only, then nothing.
    let mut first = [0u8; 64];
    socket.read_exact(&mut first).expect("response starts");
    let (mut last, mut steady_since) = (-1.0, Instant::now());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60)
        && steady_since.elapsed() < Duration::from_secs(1)
    {
        let generated = server.metric("kiln_generation_tokens_total");
        if generated != last {
            (last, steady_since) = (generated, Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        last > 0.0 && last < 2000.0,
        "{last} tokens generated for a client that reads nothing"
    );
    assert!(
        server.metric("kiln_kv_usage") > 0.0,
        "paused, its pages kept"
    );
    let start = Instant::now();
    while server.metric("kiln_requests_aborted_total") < 1.0 {
        assert!(start.elapsed() < Duration::from_secs(30), "never aborted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.metric("kiln_kv_usage"), 0.0);
    assert_eq!(server.metric("kiln_num_running_reqs"), 0.0);
    assert!(server.log_text().contains("client stalled"));
    drop(socket);
    let (status, _) = post(
        &format!("{}/v1/completions", server.url),
        json!({"prompt": "next", "max_tokens": 2}).to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200);
}

/// The embedded model made to answer every position with the tool-call section marker.
fn marker_model(dir: &Path) {
    let marker = kiln::model::default_model::codec()
        .token_id("<|tool_calls_section_begin|>")
        .expect("chat tokens") as usize;
    common::scripted_model(dir, |_| marker);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tools_on_offer_the_tool_call_marker_ends_the_turn() {
    let _cpu = shared();
    let dir = tempfile::tempdir().unwrap();
    marker_model(dir.path());
    let server = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let url = format!("{}/v1/chat/completions", server.url);
    let ask = json!([{"role": "user", "content": "list the files"}]);
    for extra in [
        json!({}),
        json!({"tool_choice": "none", "tools": [
        {"type": "function", "function": {"name": "ls"}}]}),
    ] {
        let mut body = json!({"messages": ask, "max_tokens": 16, "return_token_ids": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, reply) = post(&url, body.to_string(), None).await;
        assert_eq!(status, 200, "{reply}");
        let choice = &reply["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{reply}");
        assert!(choice["message"].get("tool_calls").is_none(), "{reply}");
        assert_eq!(choice["message"]["content"], "", "{reply}");
        body["stream"] = json!(true);
        let events = read_stream(&reqwest::Client::new(), &url, body, None).await;
        assert!(
            events.iter().all(|e| !e.contains("tool_calls")),
            "{events:?}"
        );
        assert!(
            events
                .iter()
                .any(|e| e.contains("\"finish_reason\":\"stop\"")),
            "{events:?}"
        );
    }
    // Offered tools, the model's marker starts a section; nothing in it calls a tool.
    let (status, reply) = post(
        &url,
        json!({"messages": ask, "max_tokens": 8,
               "tools": [{"type": "function", "function": {"name": "ls"}}]})
        .to_string(),
        None,
    )
    .await;
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply["choices"][0]["message"].get("tool_calls").is_none(),
        "{reply}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_an_openai_error_naming_its_field() {
    let _cpu = shared();
    let server = Server::start(&["--api-key", "k1"]);
    let http = reqwest::Client::new();
    let at = |path: &str| format!("{}{path}", server.url);
    // 405 and 415 in the same shape as every other error.
    let resp = http
        .get(at("/v1/chat/completions"))
        .bearer_auth("k1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    let resp = http
        .post(at("/v1/completions"))
        .header("authorization", "bearer k1")
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 415, "the lowercase scheme is accepted");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    // The official client's models.retrieve.
    let model = |id: &str| {
        http.get(at(&format!("/v1/models/{id}")))
            .bearer_auth("k1")
            .send()
    };
    let found: Value = model("kiln-tiny-random")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(found["id"], "kiln-tiny-random");
    assert_eq!(model("gpt-9").await.unwrap().status(), 404);
    // Fields kiln cannot honour are refused by name.
    let refused = |path: &'static str, body: Value| {
        let (http, url) = (http.clone(), at(path));
        async move {
            let resp = http
                .post(url)
                .bearer_auth("k1")
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap();
            assert_eq!(status, 400, "{body}");
            body["error"]["param"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }
    };
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let cases = [
        (
            "/v1/chat/completions",
            chat(json!({"frequency_penalty": 0.5})),
            "frequency_penalty",
        ),
        ("/v1/chat/completions", chat(json!({"top_k": -3})), "top_k"),
        ("/v1/chat/completions", chat(json!({"min_p": 1.5})), "min_p"),
        (
            "/v1/chat/completions",
            chat(json!({"tool_choice": "required"})),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tool_choice": "bogus"})),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function"}]})),
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            chat(
                json!({"tools": [{"type": "function", "function": {"name": "ls"}}],
                        "tool_choice": {"type": "function", "function": {"name": "rm"}}}),
            ),
            "tool_choice",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "presence_penalty": 1}),
            "presence_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temprature": 0}),
            "temprature",
        ),
        (
            "/generate",
            json!({"input_ids": [5], "return_logprob": true, "top_logprobs_num": 21}),
            "top_logprobs_num",
        ),
        (
            "/generate",
            json!({"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}),
            "sampling_params.max_new_tokens",
        ),
        (
            "/generate",
            json!({"input_ids": [5], "sampling_params": {"top_k": -7}}),
            "sampling_params.top_k",
        ),
        (
            "/generate",
            json!({"input_ids": [5], "sampling_params": {"min_p": -0.1}}),
            "sampling_params.min_p",
        ),
    ];
    for (path, body, param) in cases {
        assert_eq!(refused(path, body.clone()).await, param, "{path} {body}");
    }
    let resp = http
        .post(at("/generate"))
        .bearer_auth("k1")
        .json(&json!({"input_ids": [5], "model": "gpt-9"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    // Fields left at their neutral values are accepted.
    let ok = chat(json!({"frequency_penalty": 0, "user": "me", "tool_choice": "auto"}));
    let resp = http
        .post(at("/v1/chat/completions"))
        .bearer_auth("k1")
        .json(&ok)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
}

#[test]
fn an_empty_api_key_is_refused_at_start_up() {
    let _cpu = shared();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--port", "0"])
        .env("KILN_API_KEY", "")
        .output()
        .expect("kiln runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("KILN_API_KEY") && stderr.contains("empty"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_streams_half_of_them_abandoned_leave_nothing_behind() {
    let _cpu = shared();
    let server = Server::start(&["--max-running-requests", "64"]);
    let url = format!("{}/v1/completions", server.url);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let streams = (0..200u32).map(|i| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let body = json!({"prompt": [3 + i % 300, 7, 9], "max_tokens": 40,
                              "stream": true, "ignore_eos": true});
            let resp = http.post(&url).json(&body).send().await.expect("sent");
            let mut bytes = resp.bytes_stream();
            if i % 2 == 1 {
                // Read a little, then go away mid-stream.
                let _ = bytes.next().await;
                return None;
            }
            let mut text = String::new();
            while let Some(chunk) = bytes.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk.expect("read")));
            }
            Some(text)
        }
    });
    let results = futures_util::future::join_all(streams).await;
    for text in results.iter().flatten() {
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert_eq!(
            text.matches("\"finish_reason\":\"length\"").count(),
            1,
            "{text}"
        );
    }
    let start = Instant::now();
    while server.metric("kiln_num_running_reqs") + server.metric("kiln_num_queue_reqs") > 0.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "requests left running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.metric("kiln_kv_usage"), 0.0);
    let ended = server.metric("kiln_requests_finished_total")
        + server.metric("kiln_requests_aborted_total");
    assert_eq!(ended, 200.0);
    assert!(server.metric("kiln_requests_aborted_total") >= 1.0);
}
