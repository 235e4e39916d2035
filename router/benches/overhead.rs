//! Router overhead: the latency `kiln route` adds at 2,000 requests/s on loopback.
//!
//! Stand-in replicas (not kiln: minimal axum servers whose only job is to answer at
//! once, with a fixed chat completion and a kiln-style /metrics) run in process, as does
//! the router with the `kiln` policy, its health loop scraping them; each on its own
//! runtime. The load is open
//! loop: every millisecond for `--seconds` (default 10), 2 chat requests go through the
//! router (2,000 req/s) and 2 for the same sessions straight to the stand-ins, so both
//! paths share the machine's noise; each is one of 500 sessions (`x-session-id`). The
//! added latency at a quantile is the difference of the two paths'. Before timing, one buffered and
//! one streamed (SSE) response are checked to pass through byte for byte.
//!
//! Prints a table and writes JSON (`--json FILE`, default
//! `target/router-overhead.json`). Passes when p99 added latency < 1 ms with no errors.
//! Everything shares this machine's cores, so the figure is an upper bound.

use axum::body::Body;
use axum::http::header;
use axum::routing::{get, post};
use kiln_router::placer::Placer;
use kiln_router::policy::{KilnParams, PolicyName};
use kiln_router::proxy::{app, AppState};
use kiln_router::replicas::ReplicaSource;
use std::sync::Arc;
use std::time::{Duration, Instant};

const COMPLETION: &str = r#"{"id":"c","object":"chat.completion","model":"kiln-default","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}}"#;
const SSE: [&str; 3] = [
    "data: {\"choices\":[{\"delta\":{\"content\":\"o\"}}]}\n\n",
    "data: {\"choices\":[{\"delta\":{\"content\":\"k\"}}]}\n\n",
    "data: [DONE]\n\n",
];
const METRICS: &str = "kiln_num_running_reqs 0\nkiln_num_queue_reqs 0\nkiln_kv_usage 0.1\n";
const SESSIONS: u64 = 500;
const PER_MS: usize = 2;

async fn stand_in() -> String {
    async fn chat(body: String) -> axum::response::Response {
        if body.contains("\"stream\":true") {
            let chunks =
                futures_util::stream::iter(SSE.map(|c| Ok::<_, std::io::Error>(c.to_string())));
            return (
                [(header::CONTENT_TYPE, "text/event-stream")],
                Body::from_stream(chunks),
            )
                .into_response();
        }
        ([(header::CONTENT_TYPE, "application/json")], COMPLETION).into_response()
    }
    use axum::response::IntoResponse;
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/metrics", get(|| async { METRICS }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("stand-in serves") });
    url
}

fn body(session: u64, stream: bool) -> String {
    format!(
        r#"{{"model":"kiln-default","stream":{stream},"messages":[{{"role":"system","content":"agent"}},{{"role":"user","content":"task {session}"}}]}}"#
    )
}

/// Latencies (sorted, ms), failed requests and achieved requests/s of one path.
type PathResult = (Vec<f64>, usize, f64);

/// Open-loop load: every millisecond `PER_MS` requests go straight to a stand-in and
/// `PER_MS` through the router, for the same sessions, so both paths see the same
/// machine noise. Returns (direct, routed).
async fn load(
    client: &reqwest::Client,
    seconds: u64,
    replicas: &[String],
    router: &str,
) -> (PathResult, PathResult) {
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = Instant::now();
    let mut tasks = [Vec::new(), Vec::new()];
    let mut n = 0u64;
    while start.elapsed() < Duration::from_secs(seconds) {
        ticker.tick().await;
        for _ in 0..PER_MS {
            let session = n % SESSIONS;
            n += 1;
            let direct = &replicas[(session % replicas.len() as u64) as usize];
            for (path, base) in [direct.as_str(), router].into_iter().enumerate() {
                let request = client
                    .post(format!("{base}/v1/chat/completions"))
                    .header("x-session-id", format!("s{session}"))
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(body(session, false));
                tasks[path].push(tokio::spawn(async move {
                    let t = Instant::now();
                    let ok = match request.send().await {
                        Ok(r) if r.status().is_success() => {
                            r.bytes().await.is_ok_and(|b| b == COMPLETION.as_bytes())
                        }
                        _ => false,
                    };
                    (ok, t.elapsed().as_secs_f64() * 1000.0)
                }));
            }
        }
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let [direct, routed] = tasks;
    (collect(direct, rate).await, collect(routed, rate).await)
}

async fn collect(tasks: Vec<tokio::task::JoinHandle<(bool, f64)>>, rate: f64) -> PathResult {
    let mut latencies = Vec::with_capacity(tasks.len());
    let mut errors = 0;
    for task in tasks {
        let (ok, ms) = task.await.expect("request task");
        errors += usize::from(!ok);
        latencies.push(ms);
    }
    latencies.sort_by(f64::total_cmp);
    (latencies, errors, rate)
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1]
}

async fn validate(client: &reqwest::Client, router: &str) {
    for stream in [false, true] {
        let response = client
            .post(format!("{router}/v1/chat/completions"))
            .body(body(1, stream))
            .send()
            .await
            .expect("router answers");
        let bytes = response.bytes().await.expect("body");
        let expected = if stream {
            SSE.concat()
        } else {
            COMPLETION.to_string()
        };
        assert_eq!(
            bytes,
            expected.as_bytes(),
            "the router changed a response (stream: {stream})"
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let seconds: u64 = flag("--seconds").map_or(10, |s| s.parse().expect("--seconds N"));
    let json = flag("--json").unwrap_or_else(|| "target/router-overhead.json".into());
    // Stand-ins, router and client each get their own runtime (as separate processes
    // would), so one's burst of tasks does not queue behind another's.
    let runtime = |workers| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .expect("runtime")
    };
    let (replica_rt, router_rt, client_rt) = (runtime(1), runtime(2), runtime(2));
    let replicas =
        replica_rt.block_on(async { vec![stand_in().await, stand_in().await, stand_in().await] });
    let router = router_rt.block_on(async {
        let source = ReplicaSource {
            urls: replicas.clone(),
            file: None,
        };
        let placer = Placer::new(PolicyName::Kiln, KilnParams::default(), 1);
        let state = Arc::new(AppState::new(placer, source).expect("router state"));
        tokio::spawn(kiln_router::health::upkeep(
            state.clone(),
            Duration::from_millis(500),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let router = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move {
            axum::serve(listener, app(state))
                .await
                .expect("router serves")
        });
        router
    });
    client_rt.block_on(async move {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(4096)
            .tcp_nodelay(true)
            .build()
            .expect("client");
        validate(&client, &router).await;
        // Warm both paths' connection pools, then measure.
        load(&client, 1, &replicas, &router).await;
        let (direct, routed) = load(&client, seconds, &replicas, &router).await;
        report(&direct, &routed, &json);
    });
    drop((replica_rt, router_rt));
}

fn report(direct: &PathResult, routed: &PathResult, json: &str) {
    let qs = [("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999)];
    println!("router overhead on loopback, kiln policy, stand-in replicas (answer at once)");
    println!("| path | requests | req/s | errors | p50 ms | p90 ms | p99 ms | p99.9 ms |");
    println!("|---|---|---|---|---|---|---|---|");
    for (name, (lat, errors, rate)) in [("direct", direct), ("via router", routed)] {
        let cells: Vec<String> = qs
            .iter()
            .map(|&(_, q)| format!("{:.3}", quantile(lat, q)))
            .collect();
        println!(
            "| {name} | {} | {rate:.0} | {errors} | {} |",
            lat.len(),
            cells.join(" | ")
        );
    }
    let added: Vec<(&str, f64)> = qs
        .iter()
        .map(|&(n, q)| (n, quantile(&routed.0, q) - quantile(&direct.0, q)))
        .collect();
    let cells: Vec<String> = added.iter().map(|(_, ms)| format!("{ms:.3}")).collect();
    println!("| added | | | | {} |", cells.join(" | "));
    let p99_added = added[2].1;
    let pass = p99_added < 1.0 && routed.1 == 0 && direct.1 == 0;
    println!(
        "p99 added latency {p99_added:.3} ms (target < 1 ms), errors {}: {}",
        routed.1,
        if pass { "PASS" } else { "FAIL" }
    );
    let value = serde_json::json!({
        "bench": "router_overhead",
        "replicas": "in-process stand-ins that answer at once (not kiln)",
        "policy": "kiln",
        "target_rate_per_s": PER_MS * 1000,
        "direct": {"requests": direct.0.len(), "rate_per_s": direct.2, "errors": direct.1,
                   "latency_ms": qs.iter().map(|&(n, q)| (n, quantile(&direct.0, q))).collect::<std::collections::BTreeMap<_, _>>()},
        "routed": {"requests": routed.0.len(), "rate_per_s": routed.2, "errors": routed.1,
                   "latency_ms": qs.iter().map(|&(n, q)| (n, quantile(&routed.0, q))).collect::<std::collections::BTreeMap<_, _>>()},
        "added_latency_ms": added.iter().copied().collect::<std::collections::BTreeMap<_, _>>(),
        "pass": pass,
    });
    std::fs::write(
        json,
        serde_json::to_string_pretty(&value).expect("json") + "\n",
    )
    .expect("write the JSON report");
    println!("wrote {json}");
}
