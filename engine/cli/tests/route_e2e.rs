//! `kiln route` end to end: three real `kiln serve` replicas (the embedded model) on
//! loopback behind a real router process. Multi-turn agent sessions reach a cache hit
//! rate close to the same sessions on one replica; killing a replica mid-run loses no
//! session (its sessions continue on the others) and the router counts the retries.
mod common;

use common::server::Server;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `kiln route --port 0` process in front of `replicas`, killed when dropped.
struct Router {
    child: Child,
    url: String,
}

impl Router {
    fn start(replicas: &[&Server], extra: &[&str]) -> Router {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kiln"));
        command.args(["route", "--port", "0"]).args(extra);
        for r in replicas {
            command.args(["--replica", &r.url]);
        }
        let mut child = command
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kiln route starts");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("kiln route listens");
        let url = line
            .strip_prefix("kiln route listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Router { child, url }
    }

    /// The router's /metrics text.
    async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.url))
            .await
            .expect("router metrics")
            .text()
            .await
            .expect("text")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of an unlabelled or exactly labelled series in Prometheus text.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A long shared system prompt, like a coding agent's.
fn agent_prompt() -> String {
    "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). ".repeat(16)
}

/// An agent session's conversation so far; `header` says whether it sends `x-session-id`
/// (the others rely on the router hashing their first messages).
struct Session {
    id: usize,
    header: bool,
    messages: Vec<Value>,
}

impl Session {
    fn new(id: usize) -> Session {
        let messages = vec![json!({"role": "system", "content": agent_prompt()})];
        Session {
            id,
            header: id.is_multiple_of(2),
            messages,
        }
    }

    /// Sends the next turn to `url`; returns (prompt tokens, cached tokens).
    async fn turn(&mut self, client: &reqwest::Client, url: &str) -> (u64, u64) {
        let n = self.messages.len();
        self.messages.push(json!({"role": "user", "content": format!("Session {}, step {n}: fix the failing test.", self.id)}));
        let body = json!({"model": "kiln-tiny-random", "messages": self.messages, "max_tokens": 4, "temperature": 0.0});
        let mut request = client
            .post(format!("{url}/v1/chat/completions"))
            .json(&body);
        if self.header {
            request = request.header("x-session-id", format!("session-{}", self.id));
        }
        let response = request.send().await.expect("the router answers");
        let status = response.status();
        let reply: Value = response.json().await.expect("a JSON reply");
        assert!(
            status.is_success(),
            "session {} failed: {status} {reply}",
            self.id
        );
        let content = reply["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        self.messages
            .push(json!({"role": "assistant", "content": content}));
        let usage = &reply["usage"];
        let prompt = usage["prompt_tokens"].as_u64().expect("prompt_tokens");
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens");
        (prompt, cached)
    }
}

/// Runs `turns` turns of every session concurrently against `url`; returns the prompt and
/// cached tokens of each turn.
async fn run_turns(
    client: &reqwest::Client,
    url: &str,
    sessions: &mut [Session],
    turns: usize,
) -> Vec<(u64, u64)> {
    let mut per_turn = Vec::new();
    for _ in 0..turns {
        let results =
            futures_util::future::join_all(sessions.iter_mut().map(|s| s.turn(client, url))).await;
        per_turn.push(
            results
                .iter()
                .fold((0, 0), |(p, c), &(dp, dc)| (p + dp, c + dc)),
        );
    }
    per_turn
}

/// Cached over prompt tokens of `turns`.
fn hit_rate(turns: &[(u64, u64)]) -> f64 {
    let (prompt, cached) = turns
        .iter()
        .fold((0, 0), |(p, c), &(dp, dc)| (p + dp, c + dc));
    cached as f64 / prompt as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_behind_the_router_hit_the_cache_about_as_often_as_on_one_replica() {
    let client = reqwest::Client::new();
    let (sessions, turns) = (6, 4);
    let single = Server::start(&["--page-size", "16"]);
    let alone = run_turns(
        &client,
        &single.url,
        &mut (0..sessions).map(Session::new).collect::<Vec<_>>(),
        turns,
    )
    .await;
    drop(single);

    let replicas: Vec<Server> = (0..3)
        .map(|_| Server::start(&["--page-size", "16"]))
        .collect();
    let router = Router::start(&replicas.iter().collect::<Vec<_>>(), &[]);
    let routed = run_turns(
        &client,
        &router.url,
        &mut (0..sessions).map(Session::new).collect::<Vec<_>>(),
        turns,
    )
    .await;

    println!(
        "cache hit rate, all turns: one replica {:.3}, three behind the router {:.3}; later turns: {:.3} and {:.3}",
        hit_rate(&alone),
        hit_rate(&routed),
        hit_rate(&alone[1..]),
        hit_rate(&routed[1..])
    );
    // Later turns re-send their session's history: with affinity they hit exactly as on
    // one replica. First turns differ only by the shared system prompt, which each
    // replica computes once (at most one cold prefill per session).
    assert!(
        (hit_rate(&routed[1..]) - hit_rate(&alone[1..])).abs() < 0.01,
        "routed {routed:?} vs alone {alone:?}"
    );
    let total_prompt: u64 = alone.iter().map(|t| t.0).sum();
    let bound = alone[0].0 as f64 / total_prompt as f64;
    assert!(
        hit_rate(&routed) > hit_rate(&alone) - bound,
        "routed {routed:?} vs alone {alone:?}"
    );
    let metrics = router.metrics().await;
    assert_eq!(
        series(&metrics, "kiln_router_moves_total"),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        series(&metrics, "kiln_router_retries_total"),
        Some(0.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_a_replica_mid_run_loses_no_session_and_counts_the_retries() {
    let client = reqwest::Client::new();
    let mut replicas: Vec<Server> = (0..3)
        .map(|_| Server::start(&["--page-size", "16"]))
        .collect();
    // Slow health checks, so the dead replica is found by requests (and retried).
    let router = Router::start(
        &replicas.iter().collect::<Vec<_>>(),
        &["--scrape-interval-ms", "60000"],
    );
    let mut sessions: Vec<Session> = (0..6).map(Session::new).collect();
    run_turns(&client, &router.url, &mut sessions, 2).await;

    let metrics = router.metrics().await;
    let homed = |r: &Server| {
        series(
            &metrics,
            &format!("kiln_router_sessions{{replica=\"{}\"}}", r.url),
        )
        .unwrap_or(0.0)
    };
    let victim = (0..replicas.len())
        .max_by(|&a, &b| homed(&replicas[a]).total_cmp(&homed(&replicas[b])))
        .expect("replicas");
    let lost_sessions = homed(&replicas[victim]);
    assert!(lost_sessions >= 1.0, "{metrics}");
    let victim_url = replicas[victim].url.clone();
    drop(replicas.remove(victim));

    // Every session carries on; each request that met the dead replica was retried.
    run_turns(&client, &router.url, &mut sessions, 2).await;
    let metrics = router.metrics().await;
    let retries = series(&metrics, "kiln_router_retries_total").expect("retries counted");
    let moves = series(&metrics, "kiln_router_moves_total").expect("moves counted");
    assert!(retries >= 1.0, "no retry counted: {metrics}");
    assert!(
        moves >= lost_sessions,
        "{lost_sessions} sessions lost their replica, {moves} moves: {metrics}"
    );
    let up = series(
        &metrics,
        &format!("kiln_router_replica_up{{replica=\"{victim_url}\"}}"),
    );
    assert_eq!(up, Some(0.0), "the dead replica is still up: {metrics}");
}

#[test]
fn route_simulate_prints_the_table_and_writes_one_json_object_per_policy() {
    let json = std::env::temp_dir().join(format!("kiln-route-sim-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "route",
            "--simulate",
            "--sim-replicas",
            "10",
            "--json",
            json.to_str().unwrap(),
        ])
        .output()
        .expect("kiln route --simulate runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("| policy | var/mean |") && stdout.contains("kiln targets:"),
        "{stdout}"
    );
    let reports: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let policies: Vec<&str> = reports
        .iter()
        .map(|r| r["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["random", "session-hash", "kiln"]);
    for r in &reports {
        let mut fields: Vec<&String> = r.as_object().unwrap().keys().collect();
        fields.sort();
        assert_eq!(
            fields,
            [
                "affinity",
                "moves_per_scale_event",
                "p99_queue_delay_ms",
                "p_load_ge_12",
                "p_load_le_1",
                "policy",
                "var_over_mean"
            ]
        );
    }
}

/// A replica that dies mid-stream cannot be retried past the first byte: the client's
/// stream ends with an SSE error event (and `[DONE]`), not a silent cut, and the router
/// counts it. A replica draining for shutdown leaves the rotation at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_cut_by_its_replica_ends_with_an_error_event_and_draining_replicas_rest() {
    let mut replicas: Vec<Server> = (0..2)
        .map(|_| Server::start(&["--shutdown-timeout", "60"]))
        .collect();
    let router = Router::start(
        &replicas.iter().collect::<Vec<_>>(),
        &["--scrape-interval-ms", "100"],
    );
    let http = reqwest::Client::new();
    let long = |session: &str| {
        let req = http
            .post(format!("{}/v1/completions", router.url))
            .header("x-session-id", session)
            .json(
                &json!({"prompt": [5, 6, 7], "max_tokens": 4000, "stream": true,
                          "ignore_eos": true}),
            );
        async move {
            let mut bytes = req.send().await.expect("sent").bytes_stream();
            let first = bytes.next().await.expect("a first chunk").expect("read");
            (String::from_utf8_lossy(&first).into_owned(), bytes)
        }
    };
    let (_, mut stream) = long("cut").await;
    // Which replica serves it: the one with a running request.
    let serving = (0..2)
        .find(|&i| replicas[i].metric("kiln_num_running_reqs") > 0.0)
        .expect("one replica runs the stream");
    drop(replicas.remove(serving));
    let mut rest = String::new();
    {
        while let Some(chunk) = stream.next().await {
            rest.push_str(&String::from_utf8_lossy(
                &chunk.expect("the router ends it cleanly"),
            ));
        }
    }
    let tail: Vec<&str> = rest.trim_end().rsplit("\n\n").take(2).collect();
    assert_eq!(tail[0].trim(), "data: [DONE]", "{rest}");
    assert!(tail[1].contains("replica_stream_broken"), "{rest}");
    let metrics = router.metrics().await;
    assert_eq!(
        series(&metrics, "kiln_router_broken_streams_total"),
        Some(1.0),
        "{metrics}"
    );

    // The survivor drains (a stream keeps it draining): the router takes it out.
    let survivor = &replicas[0];
    let (_, _keep) = long("drain").await;
    survivor.terminate();
    let up = format!("kiln_router_replica_up{{replica=\"{}\"}}", survivor.url);
    let start = std::time::Instant::now();
    loop {
        let metrics = router.metrics().await;
        if series(&metrics, &up) == Some(0.0) {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{metrics}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
