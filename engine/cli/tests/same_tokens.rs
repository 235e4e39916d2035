//! Engine features that must not change what a model says, each over HTTP against a server
//! without it: speculative decoding, the overlapped schedule, MLA's per-head prefill and
//! the host KV tier (real `kiln serve` processes, the tiny random model on wgpu/llvmpipe in
//! CI, concurrent clients).
mod common;

use common::post;
use common::server::Server;
use serde_json::{json, Value};

/// A greedy `/generate` body: `prompt`'s ids, `max_new_tokens` through any end token.
fn greedy(prompt: &[u32], max_new_tokens: usize) -> Value {
    json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens,
           "temperature": 0, "ignore_eos": true}})
}

/// Every body posted to `server`'s `/generate` at once; the replies in order.
async fn generate_all(server: &Server, bodies: &[Value]) -> Vec<(u16, Value)> {
    let url = format!("{}/generate", server.url);
    let calls = bodies.iter().map(|b| post(&url, b.to_string(), None));
    futures_util::future::join_all(calls).await
}

/// `--speculative ngram`: greedy outputs over HTTP are the same tokens as without it, for
/// prompts the drafter gets right (repeats) and wrong, sent together in mixed batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speculative_decoding_over_http_gives_the_same_greedy_tokens() {
    let plain = Server::start(&[]);
    // Drafting at every step (the measured policy would stop where verification on
    // llvmpipe costs more than it earns): the most drafts to check.
    let spec_args = |drafter, policy| {
        [
            "--speculative",
            drafter,
            "--max-draft-tokens",
            "4",
            "--draft-policy",
            policy,
        ]
    };
    let spec = Server::start(&spec_args("ngram", "fixed"));
    let suffix = Server::start(&spec_args("suffix", "fixed"));
    // The measured policy drafts where it pays and overlaps the steps where it drafts
    // nothing (which steps those are depends on llvmpipe's timings).
    let measured = Server::start(&spec_args("suffix", "measured"));
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|i| match i % 3 {
            0 => (0..30).map(|t| 5 + (t + i) % 6).collect(),
            1 => (0..20).map(|t| 3 + (t * 37 + i * 11) % 500).collect(),
            _ => [
                vec![40 + i, 41, 42, 43],
                vec![40 + i, 41, 42, 43],
                vec![40 + i, 41],
            ]
            .concat(),
        })
        .collect();
    let bodies: Vec<Value> = prompts.iter().map(|p| greedy(p, 40)).collect();
    let (a, b, c, d) = tokio::join!(
        generate_all(&plain, &bodies),
        generate_all(&spec, &bodies),
        generate_all(&suffix, &bodies),
        generate_all(&measured, &bodies)
    );
    for (i, (((sa, ra), (sb, rb)), (sc, rc))) in a.iter().zip(&b).zip(&c).enumerate() {
        assert_eq!((*sa, *sb, *sc), (200, 200, 200), "{ra} {rb} {rc}");
        assert_eq!(ra["output_ids"], rb["output_ids"], "prompt {i}, ngram");
        assert_eq!(ra["output_ids"], rc["output_ids"], "prompt {i}, suffix");
        assert_eq!(d[i].0, 200, "{}", d[i].1);
        assert_eq!(
            ra["output_ids"], d[i].1["output_ids"],
            "prompt {i}, measured"
        );
    }
    assert!(spec.metric("kiln_spec_drafted_tokens_total") > 0.0);
    assert!(suffix.metric("kiln_spec_drafted_tokens_total") > 0.0);
    assert!(suffix.metric("kiln_spec_drafter_bytes") > 0.0);
    let accepted = spec.metric("kiln_spec_accepted_tokens_total");
    let verified: u64 = b
        .iter()
        .filter_map(|(_, r)| r["meta_info"]["spec_verify_ct"].as_u64())
        .sum();
    assert!(verified > 0, "meta_info reports verification steps");
    eprintln!("accepted {accepted} drafted tokens over {verified} verification steps");
    eprintln!(
        "measured policy: {} tokens drafted, {} steps overlapped",
        measured.metric("kiln_spec_drafted_tokens_total"),
        measured.metric("kiln_overlapped_steps_total")
    );
}

/// The overlapped schedule (the default: each step planned and issued while the one before
/// runs, its input ids read on the device) against `--disable-overlap-schedule`: the same
/// tokens over HTTP for greedy and seeded sampled requests, with log-probabilities, stop
/// ids and lengths that end requests mid-batch, sent together into a pool small enough
/// to preempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_overlapped_schedule_gives_the_same_tokens_as_waiting_for_each_step() {
    let small_pool = [
        "--page-size",
        "16",
        "--kv-pages",
        "12",
        "--host-kv-gib",
        "0",
    ];
    let overlapped = Server::start(&small_pool);
    let waiting = Server::start(&[&small_pool[..], &["--disable-overlap-schedule"]].concat());
    let bodies: Vec<Value> = (0..12u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..20 + 3 * i)
                .map(|t| 5 + (t * 31 + i * 7) % 400)
                .collect();
            let mut params = json!({"max_new_tokens": 8 + 5 * (i % 5), "ignore_eos": true,
                                    "temperature": if i % 2 == 0 { 0.0 } else { 0.9 },
                                    "seed": i});
            if i % 4 == 1 {
                params["stop_token_ids"] = json!((5..45).collect::<Vec<u32>>());
            }
            json!({"input_ids": prompt, "sampling_params": params,
                   "return_logprob": i % 3 == 0, "top_logprobs_num": 2})
        })
        .collect();
    let (a, b) = tokio::join!(
        generate_all(&overlapped, &bodies),
        generate_all(&waiting, &bodies)
    );
    for (i, ((sa, ra), (sb, rb))) in a.iter().zip(&b).enumerate() {
        assert_eq!((*sa, *sb), (200, 200), "{ra} {rb}");
        assert_eq!(ra["output_ids"], rb["output_ids"], "request {i}");
        assert_eq!(
            ra["meta_info"]["finish_reason"], rb["meta_info"]["finish_reason"],
            "request {i}"
        );
    }
    assert!(overlapped.metric("kiln_overlapped_steps_total") > 0.0);
    assert_eq!(waiting.metric("kiln_overlapped_steps_total"), 0.0);
    assert!(
        overlapped.metric("kiln_preemptions_total") + waiting.metric("kiln_preemptions_total")
            > 0.0
    );
}

/// Prompts long enough to prefill in MLA's per-head form (the default from 512 new tokens
/// on wgpu) sent together with short ones (absorbed in the same steps): the same greedy
/// tokens as a server that attends absorbed only (`--mla-per-head-from 0`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_head_prefill_gives_the_same_greedy_tokens_as_absorbed() {
    let mixed = Server::start(&[]);
    let absorbed = Server::start(&["--mla-per-head-from", "0"]);
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            let len = if i % 2 == 0 { 600 + 40 * i } else { 12 + i };
            (0..len).map(|t| 5 + (t * 37 + i * 11) % 400).collect()
        })
        .collect();
    let bodies: Vec<Value> = prompts.iter().map(|p| greedy(p, 8)).collect();
    let (a, b) = tokio::join!(
        generate_all(&mixed, &bodies),
        generate_all(&absorbed, &bodies)
    );
    for (i, ((sa, ra), (sb, rb))) in a.iter().zip(&b).enumerate() {
        assert_eq!((*sa, *sb), (200, 200), "{ra} {rb}");
        assert_eq!(ra["output_ids"], rb["output_ids"], "prompt {i}");
    }
}

/// Agent sessions whose histories outgrow the device pool (12 pages of 16 tokens for six
/// sessions of up to ~180 tokens), turn after turn: with the host tier the later turns hit
/// what the device pool evicted (copied back), and the greedy outputs are those of a
/// server whose pool holds everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_turns_hit_the_host_tier_and_answer_as_a_pool_that_holds_everything() {
    let tiered = Server::start(&[
        "--page-size",
        "16",
        "--kv-pages",
        "12",
        "--host-kv-gib",
        "0.1",
    ]);
    let roomy = Server::start(&[
        "--page-size",
        "16",
        "--kv-pages",
        "256",
        "--host-kv-gib",
        "0",
    ]);
    let mut histories: Vec<Vec<u32>> = (0..6u32).map(|s| vec![30 + s, 31, 32]).collect();
    let mut later_cached = Vec::new();
    for turn in 0..4u32 {
        for (s, history) in histories.iter_mut().enumerate() {
            history.extend((0..36u32).map(|t| 40 + (t * 13 + turn * 7 + s as u32 * 31) % 400));
            let body = greedy(history, 6).to_string();
            let (sa, a) = post(&format!("{}/generate", tiered.url), body.clone(), None).await;
            let (sb, b) = post(&format!("{}/generate", roomy.url), body, None).await;
            assert_eq!((sa, sb), (200, 200), "{a} {b}");
            assert_eq!(a["output_ids"], b["output_ids"], "session {s}, turn {turn}");
            if turn > 0 {
                later_cached.push(a["meta_info"]["cached_tokens"].as_u64().unwrap());
            }
            let ids = a["output_ids"].as_array().unwrap();
            history.extend(ids.iter().map(|v| v.as_u64().unwrap() as u32));
        }
    }
    assert!(
        later_cached.iter().all(|&c| c >= 32),
        "every later turn hits its history: {later_cached:?}"
    );
    assert!(tiered.metric("kiln_host_cached_tokens_total") > 0.0);
    assert!(tiered.metric("kiln_kv_bytes_to_host_total") > 0.0);
    assert!(tiered.metric("kiln_kv_bytes_to_device_total") > 0.0);
    assert!(tiered.metric("kiln_kv_host_pages") > 0.0);
}

/// Requests sent together with one long prefix (an agent's parallel calls): each but the
/// first finds the prefix's whole pages cached, whether it came while the first was
/// prefilling (it waits for that prefill) or after, and the greedy outputs are those of
/// the same requests sent one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_sent_together_share_their_prefix_and_answer_as_sent_one_by_one() {
    let page = ["--page-size", "16"];
    let together = Server::start(&page);
    let one_by_one = Server::start(&page);
    let prefix: Vec<u32> = (0..320u32).map(|t| 5 + (t * 29) % 400).collect();
    let bodies: Vec<Value> = (0..4u32)
        .map(|i| {
            let tail = (0..10 + i).map(|t| 5 + (t * 17 + i * 53) % 400);
            greedy(&prefix.iter().copied().chain(tail).collect::<Vec<_>>(), 6)
        })
        .collect();
    let sent_together = generate_all(&together, &bodies).await;
    let mut cached = Vec::new();
    for (i, (body, (status, reply))) in bodies.iter().zip(&sent_together).enumerate() {
        let (alone_status, alone) = generate_all(&one_by_one, std::slice::from_ref(body))
            .await
            .remove(0);
        assert_eq!((*status, alone_status), (200, 200), "{reply} {alone}");
        assert_eq!(reply["output_ids"], alone["output_ids"], "request {i}");
        cached.push(reply["meta_info"]["cached_tokens"].as_u64().unwrap());
    }
    cached.sort();
    assert_eq!(cached[0], 0, "one request computes the prefix: {cached:?}");
    assert!(
        cached[1..].iter().all(|&c| c >= 320),
        "the others reuse its 20 pages: {cached:?}"
    );
}
