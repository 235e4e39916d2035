//! `kiln bench` end to end against a real `kiln serve` (the embedded tiny model, on the
//! CPU): a two-point sweep at small scale for a few seconds writes the JSON with every
//! metric present and the Pareto chart, and the cache hit rate it reports equals the one
//! the server's own Prometheus counters give over the same run. A small Mooncake trace
//! replays closed-loop and on its clock with the same checks.
mod common;

use common::server::Server;
use kiln_workload::report::BenchReport;
use std::path::Path;
use std::process::Command;

/// Prompt and cached token totals from the server's `/metrics`.
fn token_counters(server: &Server) -> (f64, f64) {
    (
        server.metric("kiln_prompt_tokens_total"),
        server.metric("kiln_cached_tokens_total"),
    )
}

/// Runs `kiln bench` against `server` at `scale` with `extra` arguments, writing the
/// report to `json`; panics with its stderr if it fails.
fn bench(server: &Server, json: &Path, scale: &str, extra: &[&str]) -> std::process::Output {
    // --api generate: no probe request, so the server counts exactly the bench's requests.
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "bench",
            "--url",
            &server.url,
            "--api",
            "generate",
            "--quiet",
        ])
        .args(["--scale", scale, "--json", json.to_str().unwrap()])
        .args(extra)
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .output()
        .expect("kiln bench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = server.log.display();
    assert!(
        out.status.success(),
        "kiln bench failed: {stderr}\nserver log {log}"
    );
    out
}

/// Asserts that the report's prompt and cached tokens are exactly what the server
/// counted between two readings of its counters.
fn assert_server_agrees(report: &BenchReport, before: (f64, f64), after: (f64, f64)) {
    let prompt: u64 = report.points.iter().map(|p| p.prompt_tokens).sum();
    let cached: u64 = report.points.iter().map(|p| p.cached_tokens).sum();
    assert_eq!(
        prompt as f64,
        after.0 - before.0,
        "prompt tokens differ from the server's"
    );
    let (bench_chr, server_chr) = (
        cached as f64 / prompt as f64,
        (after.1 - before.1) / (after.0 - before.0),
    );
    assert!(
        (bench_chr - server_chr).abs() < 1e-9,
        "bench CHR {bench_chr} vs server {server_chr}"
    );
}

fn read_report(json: &Path) -> BenchReport {
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[test]
fn a_short_sweep_reports_every_metric_and_the_servers_cache_hit_rate() {
    let dir = std::env::temp_dir().join(format!("kiln-bench-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let server = Server::start(&[]);
    let before = token_counters(&server);
    let (json, plot) = (dir.join("sweep.json"), dir.join("sweep.svg"));
    let plot_args = ["--plot", plot.to_str().unwrap()];
    // 8 s a point: on llvmpipe under load one cold 256-token prefill has taken 5.4 s, and a
    // point needs a request with two or more output tokens for its per-user speed.
    let sweep = ["--sweep", "1,2", "--duration", "8", "--think-scale", "0.01"];
    let out = bench(
        &server,
        &json,
        "0.015",
        &[&sweep[..], &plot_args[..]].concat(),
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("TTFT") && table.lines().count() >= 3,
        "table:\n{table}"
    );

    let report: BenchReport =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report.model, "kiln-tiny-random");
    assert_eq!(
        report
            .points
            .iter()
            .map(|p| p.concurrency)
            .collect::<Vec<_>>(),
        [1, 2]
    );
    for p in &report.points {
        assert!(
            p.requests > 0 && p.errors == 0,
            "c={}: {:?}",
            p.concurrency,
            p.error_samples
        );
        assert!(
            p.ttft_s.is_some() && p.e2e_s.is_some() && p.output_tps_per_user.is_some(),
            "c={}: a metric is missing from {} requests of {} output tokens in {:.1} s",
            p.concurrency,
            p.requests,
            p.completion_tokens,
            p.elapsed_s
        );
        assert!(p.tokens_per_min_per_gpu > 0.0 && p.output_tokens_per_min_per_gpu > 0.0);
        assert!(
            p.server_cache_hit_rate.is_some(),
            "c={}: no server counters",
            p.concurrency
        );
        let chr = p.cache_hit_rate.expect("cached_tokens reported");
        // Every turn re-sends the shared system prompt and the session's history.
        assert!(chr > 0.3, "c={}: cache hit rate {chr}", p.concurrency);
    }

    assert_server_agrees(&report, before, token_counters(&server));

    let svg = std::fs::read_to_string(plot.with_extension("svg")).unwrap();
    assert!(
        svg.contains("c=1") && svg.contains("c=2"),
        "points unlabelled in the SVG"
    );
    let png = std::fs::read(plot.with_extension("png")).unwrap();
    assert_eq!(&png[..4], b"\x89PNG");
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Mooncake trace of `n` requests, 100 ms apart: four conversations whose turns extend
/// their previous turn's blocks, behind a shared first block (the system prompt). Each
/// prompt ends 200 tokens into its last block, as recorded prompts do.
fn mooncake_trace(n: usize) -> String {
    let mut lines = String::new();
    for i in 0..n {
        let (conversation, turn) = (i % 4, i / 4);
        let mut hash_ids = vec![0u64];
        hash_ids.extend((0..=turn).map(|t| 1 + (conversation * 100 + t) as u64));
        let input_length = hash_ids.len() * 512 - 200;
        lines += &format!(
            "{{\"timestamp\": {}, \"input_length\": {input_length}, \"output_length\": 100, \"hash_ids\": {hash_ids:?}}}\n",
            i * 100
        );
    }
    lines
}

/// The cached share of [`mooncake_trace`]'s prompt tokens at `block` tokens a block,
/// when each turn finds `blocks(turn)` of its blocks cached, less `missed` blocks.
fn trace_hit_rate(n: usize, block: usize, blocks: impl Fn(usize) -> usize, missed: usize) -> f64 {
    let (mut prompt, mut cached) = (0, 0);
    for turn in (0..n).map(|i| i / 4) {
        prompt += (turn + 2) * block - 200 * block / 512;
        cached += blocks(turn) * block;
    }
    (cached - missed * block) as f64 / prompt as f64
}

#[test]
fn a_mooncake_trace_replays_closed_loop_and_on_its_clock() {
    const REQUESTS: usize = 24;
    let dir = std::env::temp_dir().join(format!("kiln-bench-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, mooncake_trace(REQUESTS)).unwrap();
    let server = Server::start(&[]);
    // Scale 1/8: 64-token blocks, the server's page size, so shared blocks are cacheable.
    // The closed loop runs to the trace's end, and each turn is sent after the one before
    // it in its conversation has its answer: it finds that turn's whole blocks cached
    // (every turn the system prompt, but the first two requests, sent together). The
    // timed replay then sends the same prompts (the same seed) on the trace's clock,
    // whether the turn before is done or not, into a cache that holds the whole trace:
    // each finds its own whole blocks. Neither rate depends on the machine's speed.
    let closed = trace_hit_rate(REQUESTS, 64, |turn| turn.max(1), 2);
    let clock = trace_hit_rate(REQUESTS, 64, |turn| turn + 1, 0);
    let trace_args = ["--trace", trace.to_str().unwrap()];
    for (mode, extra, concurrency, floor) in [
        (
            "closed",
            vec!["--sweep", "2", "--duration", "600"],
            2,
            closed,
        ),
        (
            "clock",
            vec!["--trace-clock", "--speedup", "2", "--duration", "3"],
            0,
            clock,
        ),
    ] {
        let json = dir.join(format!("{mode}.json"));
        let before = token_counters(&server);
        bench(
            &server,
            &json,
            "0.125",
            &[&trace_args[..], &extra[..]].concat(),
        );
        let report = read_report(&json);
        assert_eq!(report.points.len(), 1, "{mode}");
        let p = &report.points[0];
        assert_eq!(p.concurrency, concurrency, "{mode}");
        assert!(
            p.requests == REQUESTS as u64 && p.errors == 0,
            "{mode}: {} requests, {:?}",
            p.requests,
            p.error_samples
        );
        assert!(
            p.ttft_s.is_some() && p.output_tps_per_user.is_some(),
            "{mode}"
        );
        let chr = p.cache_hit_rate.unwrap();
        assert!(
            chr >= floor - 1e-9,
            "{mode}: CHR {chr} below the trace's {floor}"
        );
        assert_server_agrees(&report, before, token_counters(&server));
        if mode == "clock" {
            // The last request leaves 2.3 s into the trace: 1.15 s at twice its speed.
            assert!(
                p.elapsed_s >= 1.15,
                "sent ahead of the clock: {}",
                p.elapsed_s
            );
        }
    }
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}
