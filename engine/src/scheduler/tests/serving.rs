//! Scheduling without speculation: batching, paging, prefix reuse, preemption, the host
//! tier, stalled clients and sampling.
use super::*;

/// A sampled request's tokens are drawn keyed by its seed and their positions, so it
/// draws the same tokens alone and in a batch of others, on the device (no drafts) or from
/// logits (its own draft verified); another seed draws others.
#[test]
fn sampled_tokens_depend_on_seed_and_position_not_the_batch() {
    let params = |seed| SamplingParams {
        max_tokens: 24,
        temperature: 0.9,
        top_p: 0.95,
        top_k: 30,
        min_p: 0.01,
        seed,
        ..SamplingParams::default()
    };
    let prompt = periodic_prompt(3);
    let run_with = |cfg: SchedulerConfig, others: u64, seed: u64| {
        let mut run = Run::new(cfg, 1024);
        run.kv.model = soft;
        let mut rx = run.submit_params(0, prompt.clone(), params(seed), ROOM);
        let _rest: Vec<_> = (1..=others)
            .map(|i| run.submit_params(i, periodic_prompt(i as u32), params(100 + i), ROOM))
            .collect();
        run.run_to_end();
        (outcome(&mut rx).0, run.device_steps, run.logit_steps)
    };
    let (alone, device, logits) = run_with(config(4, 512, 16), 0, 5);
    assert!(
        device > 0 && logits == 0,
        "sampled without drafts on the device"
    );
    assert_eq!(run_with(config(4, 512, 16), 6, 5).0, alone);
    let (drafted, _, logits) = run_with(speculative(config(4, 512, 16), 3), 6, 5);
    assert!(logits > 0, "sampled drafts verified from logits");
    assert_eq!(drafted.len(), alone.len());
    assert_ne!(run_with(config(4, 512, 16), 0, 6).0, alone);
}

#[test]
fn decoding_requests_run_every_step_while_a_long_prompt_prefills() {
    let mut cfg = config(16, 64, 8);
    cfg.eos_token_ids.clear(); // every short request decodes all 200 tokens
    let mut run = Run::new(cfg, 1024);
    let mut short: Vec<_> = (0..3)
        .map(|i| run.submit(i, vec![1 + i as u32; 5], 200))
        .collect();
    run.step();
    let mut long = run.submit(9, vec![7; 1000], 4);
    for _ in 0..10 {
        let lens = run.step().unwrap();
        assert_eq!(
            &lens[..3],
            &[1, 1, 1],
            "every decode runs, the prefill gets the rest"
        );
        assert_eq!(
            lens[3..].iter().sum::<usize>(),
            61,
            "budget 64 minus three decodes"
        );
    }
    run.run_to_end();
    assert_eq!(outcome(&mut long).0.len(), 4);
    for rx in &mut short {
        assert_eq!(outcome(rx).0.len(), 200);
    }
}

#[test]
fn a_repeated_prompt_reuses_every_whole_cached_page() {
    let mut run = Run::new(config(4, 256, 8), 256);
    let prompt: Vec<u32> = (1..=30).collect();
    let mut first = run.submit(0, prompt.clone(), 3);
    run.run_to_end();
    let mut second = run.submit(1, prompt.clone(), 3);
    run.run_to_end();
    let (a, ua) = outcome(&mut first);
    let (b, ub) = outcome(&mut second);
    assert_eq!(a, b);
    assert_eq!(ua.unwrap().cached_tokens, 0);
    assert_eq!(ub.unwrap().cached_tokens, 28, "7 whole pages of 30 tokens");
    assert_eq!(run.metrics.cached_tokens.get(), 28);
}

/// A request whose first chunk needs more pages than eviction could free waits without
/// evicting anything: the cached prefix is still there for the turn that comes back to it.
#[test]
fn a_request_that_cannot_start_yet_evicts_nothing() {
    let cfg = SchedulerConfig {
        eos_token_ids: Vec::new(),
        ..config(4, 64, 4)
    };
    let mut run = Run::new(cfg, 12);
    let cached: Vec<u32> = (100..116).collect();
    let _first = run.submit(0, cached.clone(), 1);
    run.run_to_end();
    assert_eq!(
        run.sched.cache.cached_pages(),
        4,
        "the first turn's 16 tokens"
    );
    let running = run.submit(1, (200..222).collect(), 1000);
    run.step();
    assert_eq!(run.sched.running.len(), 1);
    // 8 pages wanted; 2 free and 4 the cache alone holds.
    let big_prompt: Vec<u32> = (300..332).collect();
    let mut big = run.submit(2, big_prompt.clone(), 1);
    run.step();
    assert_eq!(run.sched.waiting.len(), 1, "{}", run.sched.describe());
    let hit = run.sched.cache.lookup(&cached);
    assert_eq!(hit.device.len(), 4, "{}", run.sched.describe());
    drop(running);
    run.run_to_end();
    assert_eq!(
        outcome(&mut big).0,
        alone(&big_prompt, 1),
        "it starts once the pool has room, and answers as alone"
    );
}

#[test]
fn requests_sent_together_with_one_prefix_compute_it_once() {
    for overlap in [false, true] {
        // Chunks of 16 tokens: the 40-token prefix takes three steps to prefill.
        let mut run = Run::new(config(4, 16, 8), 256);
        run.overlap = overlap;
        let prefix: Vec<u32> = (1..=40).collect();
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|i| {
                prefix
                    .iter()
                    .copied()
                    .chain(100 + 10 * i..105 + 10 * i)
                    .collect()
            })
            .collect();
        let mut rxs: Vec<_> = (0..3)
            .map(|i| run.submit(i as u64, prompts[i].clone(), 4))
            .collect();
        let mut prefilled = 0;
        while let Some(lens) = run.step() {
            prefilled += lens.iter().filter(|&&n| n > 1).sum::<usize>();
        }
        assert!(run.sched.is_idle());
        let cached: Vec<usize> = (rxs.iter_mut().zip(&prompts))
            .map(|(rx, prompt)| {
                let (tokens, usage) = outcome(rx);
                assert_eq!(tokens, alone(prompt, 4), "overlap {overlap}");
                usage.unwrap().cached_tokens
            })
            .collect();
        assert_eq!(
            cached,
            [0, 40, 40],
            "overlap {overlap}: 10 whole pages shared"
        );
        assert_eq!(prefilled, 45 + 5 + 5, "overlap {overlap}: the prefix once");
        assert_eq!(run.metrics.prefill_waits.get(), 2);
    }
}

#[test]
fn a_request_sharing_a_running_prefill_waits_for_it_and_others_go_ahead() {
    let mut run = Run::new(config(4, 64, 8), 256);
    let long: Vec<u32> = (1..=100).collect();
    let mut first = run.submit(0, long.clone(), 3);
    run.step();
    // 64 of its tokens are computed, and their 16 pages cached with the chunk. Next step
    // it prefills its last 36 and leaves room for others.
    let sharing: Vec<u32> = long[..90].iter().copied().chain([7, 7, 7]).collect();
    let mut second = run.submit(1, sharing.clone(), 3);
    let other: Vec<u32> = vec![9; 10];
    let mut third = run.submit(2, other.clone(), 3);
    run.step();
    let running: Vec<u64> = run.sched.running.iter().map(|r| r.id).collect();
    assert_eq!(
        running,
        [0, 2],
        "the unrelated request starts, the sharing one waits"
    );
    // It waits for request 0's prefill of the 22 whole pages they share.
    assert_eq!(run.sched.waiting[0].waits_for, Some((0, 22)));
    run.run_to_end();
    let outcomes = [
        (&mut first, &long, 0),
        (&mut second, &sharing, 88),
        (&mut third, &other, 0),
    ];
    for (rx, prompt, cached) in outcomes {
        let (tokens, usage) = outcome(rx);
        assert_eq!(tokens, alone(prompt, 3));
        assert_eq!(
            usage.unwrap().cached_tokens,
            cached,
            "22 whole pages shared"
        );
    }
    assert_eq!(run.metrics.prefill_waits.get(), 1);
}

#[test]
fn a_short_request_starts_beside_a_long_prefill_in_progress() {
    let mut run = Run::new(config(4, 64, 8), 512);
    let long: Vec<u32> = (1..=600).collect();
    let mut first = run.submit(0, long.clone(), 3);
    assert_eq!(
        run.step().unwrap(),
        [64],
        "alone, the prefill takes the whole budget"
    );
    let short = vec![9; 10];
    let mut second = run.submit(1, short.clone(), 3);
    // Half the budget is held for the newcomer, which takes 10; the prefill gets the rest.
    assert_eq!(run.step().unwrap(), [54, 10]);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    while b.len() < 3 {
        run.step();
        b.extend(outcome(&mut second).0);
        a.extend(outcome(&mut first).0);
    }
    assert!(
        a.is_empty(),
        "the short request ends while the long one still prefills"
    );
    run.run_to_end();
    a.extend(outcome(&mut first).0);
    assert_eq!((a, b), (alone(&long, 3), alone(&short, 3)));
}

#[test]
fn a_cancelled_request_returns_its_pages() {
    let mut run = Run::new(config(4, 256, 8), 64);
    let rx = run.submit(0, vec![3; 40], 100);
    run.step();
    run.step();
    assert!(run.metrics.kv_usage.get() > 0.0);
    drop(rx);
    assert!(run.step().is_none());
    assert_eq!(run.metrics.kv_usage.get(), 0.0);
    assert_eq!(run.metrics.requests_aborted.get(), 1);
}

#[test]
fn a_request_its_client_ended_counts_as_finished_not_aborted() {
    let mut run = Run::new(config(4, 256, 8), 64);
    let (tx, rx) = channel(ROOM);
    let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    run.sched.add(Submission {
        id: 0,
        prompt: vec![3; 40],
        params: SamplingParams {
            max_tokens: 100,
            ..SamplingParams::default()
        },
        session: None,
        events: tx,
        ended_by_client: ended.clone(),
        constraint: None,
    });
    run.step();
    run.step();
    // What the server does when the text reaches a stop string.
    ended.store(true, std::sync::atomic::Ordering::Release);
    drop(rx);
    assert!(run.step().is_none());
    assert_eq!(run.metrics.kv_usage.get(), 0.0);
    assert_eq!(run.metrics.requests_finished.get(), 1);
    assert_eq!(run.metrics.requests_aborted.get(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn batched_outputs_equal_running_each_request_alone(
        page_size in 1usize..6,
        budget in 8usize..80,
        pages in 40usize..120,
        host_slots in prop_oneof![Just(0usize), 1usize..64],
        prompts in prop::collection::vec(
            (prop::collection::vec(1u32..4, 1..60), 1usize..20), 1..12),
        shared in prop::collection::vec(1u32..4, 0..40),
        overlap in any::<bool>(),
    ) {
        // Every request must fit the pool alone; sharing a prefix makes cache hits likely.
        let mut run = Run::tiered(config(page_size, budget, 8), pages, host_slots);
        run.overlap = overlap;
        let mut rxs = Vec::new();
        let mut wanted = Vec::new();
        for (i, (tail, max_tokens)) in prompts.iter().enumerate() {
            let prompt: Vec<u32> = shared.iter().chain(tail).copied().collect();
            prop_assume!(policy::fits_pool(prompt.len(), *max_tokens, page_size, pages));
            wanted.push(alone(&prompt, *max_tokens));
            rxs.push(run.submit(i as u64, prompt, *max_tokens));
            if i % 3 == 0 {
                run.step();
            }
        }
        run.run_to_end();
        for (rx, want) in rxs.iter_mut().zip(&wanted) {
            let (got, usage) = outcome(rx);
            prop_assert_eq!(&got, want);
            prop_assert!(usage.is_some());
        }
        prop_assert_eq!(run.metrics.kv_usage.get(), 0.0);
    }
}

#[test]
fn more_requests_than_the_pool_holds_all_finish_through_preemption() {
    let mut seen = HashMap::new();
    // Overlapped, a preempted request may have a token still on the device.
    for overlap in [false, true] {
        let mut run = Run::new(config(4, 64, 16), 40);
        run.overlap = overlap;
        let prompts: Vec<Vec<u32>> = (0..16).map(|i| vec![1 + (i % 3) as u32; 30 + i]).collect();
        let mut rxs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| run.submit(i as u64, p.clone(), 40))
            .collect();
        run.run_to_end();
        assert!(
            run.metrics.preemptions.get() > 0,
            "the pool of 160 tokens is oversubscribed"
        );
        for (rx, p) in rxs.iter_mut().zip(&prompts) {
            let got = outcome(rx).0;
            assert_eq!(&got, seen.entry(p.clone()).or_insert_with(|| alone(p, 40)));
        }
    }
}

/// With overlap, steps that sample on the device stay in flight while the next is planned
/// and issued: the next reads their tokens on the device, and the outputs (tokens, their
/// log-probabilities, finish reasons, usage) are those of running each step to its end
/// first, through end-of-sequence tokens, `max_tokens`, sampled and greedy requests, a
/// client that leaves mid-run and prompts arriving while others decode.
#[test]
fn overlapped_steps_feed_on_the_device_and_change_no_output() {
    let run_with = |overlap: bool| {
        let mut run = Run::new(config(4, 48, 6), 256);
        run.kv.model = soft;
        run.overlap = overlap;
        let params = |i: u64| SamplingParams {
            max_tokens: 5 + 7 * (i as usize % 4),
            temperature: if i.is_multiple_of(2) { 0.0 } else { 0.8 },
            seed: i,
            logprobs: i.is_multiple_of(3).then_some(2),
            // Some end on a token they meet on the way (the periodic prompts' 4).
            stop_token_ids: if i % 5 == 2 { vec![4] } else { Vec::new() },
            ..SamplingParams::default()
        };
        let mut rxs = Vec::new();
        for i in 0..10u64 {
            rxs.push(run.submit_params(i, periodic_prompt(i as u32), params(i), ROOM));
            run.step();
            if i == 6 {
                rxs[4].close(); // its client leaves while it decodes
            }
        }
        run.run_to_end();
        let events: Vec<Vec<Event>> = rxs
            .iter_mut()
            .map(|rx| std::iter::from_fn(|| rx.try_recv().ok()).collect())
            .collect();
        assert_eq!(run.metrics.kv_usage.get(), 0.0);
        (events, run.fed_steps, run.logit_steps)
    };
    let (mut sync, fed, _) = run_with(false);
    assert_eq!(fed, 0);
    let (mut overlapped, fed, logit_steps) = run_with(true);
    assert!(fed > 20, "{fed} steps fed on the device");
    assert_eq!(logit_steps, 0);
    // The one that left got what was read by then (a step later with overlap), no end.
    let (left, left_sync) = (overlapped.remove(4), sync.remove(4));
    for events in [&left, &left_sync] {
        assert!(!events.iter().any(|e| matches!(e, Event::Finished { .. })));
    }
    let n = left.len().min(left_sync.len());
    assert_eq!(left[..n], left_sync[..n]);
    assert_eq!(overlapped, sync);
    let finished = |e: &[Event]| matches!(e.last(), Some(Event::Finished { .. }));
    assert!(sync.iter().all(|e| finished(e)));
    let stopped = sync.iter().filter(|e| {
        matches!(
            e.last(),
            Some(Event::Finished {
                reason: FinishReason::Stop,
                ..
            })
        )
    });
    assert!(
        stopped.count() > 0,
        "some request ends on its end-of-sequence token"
    );
}

/// Agent sessions whose histories outgrow the device pool: each turn re-sends its session's
/// history. With a host tier the later turns hit what the device pool had to evict (copied
/// back, not recomputed), and every output is the same as without the tier.
#[test]
fn later_turns_hit_the_host_tier_where_the_device_pool_evicted_their_prefix() {
    let turns = |run: &mut Run| {
        let mut outputs = Vec::new();
        let mut histories: Vec<Vec<u32>> = (0..6).map(|s| vec![1 + s as u32 % 3, 2, 3]).collect();
        for turn in 0..4u32 {
            for (s, history) in histories.iter_mut().enumerate() {
                history.extend((0..20).map(|i| 1 + (i * 7 + turn + s as u32) % 3));
                let mut rx = run.submit((turn * 10 + s as u32) as u64, history.clone(), 6);
                run.run_to_end();
                let (tokens, usage) = outcome(&mut rx);
                history.extend(&tokens);
                outputs.push((tokens, usage.expect("finished").cached_tokens));
            }
        }
        outputs
    };
    let mut plain = Run::new(config(4, 64, 8), 32);
    let mut tiered = Run::tiered(config(4, 64, 8), 32, 256);
    let (without, with) = (turns(&mut plain), turns(&mut tiered));
    let tokens = |o: &[(Vec<u32>, usize)]| o.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&with), tokens(&without), "the tier changed outputs");
    let cached = |o: &[(Vec<u32>, usize)]| o.iter().map(|&(_, c)| c).sum::<usize>();
    assert!(
        cached(&with) > 2 * cached(&without),
        "cached tokens {} with the tier, {} without",
        cached(&with),
        cached(&without)
    );
    let m = &tiered.metrics;
    assert!(m.host_cached_tokens.get() > 0 && m.kv_pages_to_device.get() > 0);
    assert!(m.kv_pages_to_host.get() > 0);
}

#[test]
fn a_client_that_does_not_read_pauses_its_request_and_is_aborted_after_the_timeout() {
    let mut cfg = config(4, 256, 8);
    cfg.stall_timeout = Duration::from_millis(50);
    let mut run = Run::new(cfg, 256);
    let mut slow = run.submit_with_room(0, vec![3; 10], 1000, EVENT_BUFFER);
    let mut fast = run.submit(1, vec![4; 10], 200);
    for _ in 0..300 {
        run.step();
    }
    // Admitted plus tokens up to the slot kept for the end: the slow request is paused.
    let buffered = std::iter::from_fn(|| slow.try_recv().ok()).count();
    assert_eq!(buffered, EVENT_BUFFER - 1, "{}", run.sched.describe());
    assert!(
        outcome(&mut fast).1.is_some(),
        "the other request ran to its end"
    );
    // Reading makes room: it runs again, then stalls again.
    for _ in 0..10 {
        run.step();
    }
    let more: Vec<Event> = std::iter::from_fn(|| slow.try_recv().ok()).collect();
    assert!(
        !more.is_empty() && more.len() < EVENT_BUFFER,
        "{}",
        more.len()
    );
    for _ in 0..100 {
        run.step();
    }
    assert!(run.metrics.kv_usage.get() > 0.0, "paused, its pages kept");
    std::thread::sleep(Duration::from_millis(60));
    run.sched.abort_stalled(Instant::now());
    let ended: Vec<Event> = std::iter::from_fn(|| slow.try_recv().ok()).collect();
    assert!(
        matches!(ended.last(), Some(Event::Failed(why)) if why.contains("read none")),
        "{ended:?}"
    );
    assert_eq!(run.metrics.requests_aborted.get(), 1);
    assert_eq!(run.metrics.kv_usage.get(), 0.0, "its pages freed");
    run.sched.check_pages();
}

#[test]
fn a_paused_request_gives_its_batch_slot_to_a_waiting_one() {
    let mut run = Run::new(config(4, 256, 1), 256);
    let _slow = run.submit_with_room(0, vec![3; 10], 1000, EVENT_BUFFER);
    let mut next = run.submit(1, vec![4; 10], 20);
    for _ in 0..200 {
        run.step();
    }
    assert!(outcome(&mut next).1.is_some(), "{}", run.sched.describe());
    run.sched.check_pages();
}

/// A request that asks for log-probabilities gets them with each token, computed where the
/// token is drawn (on the device: the log-softmax of the model's logits, its token's and
/// the most likely ones', as the host computes them from a row); its tokens are those of
/// the same request without them.
#[test]
fn logprobs_come_with_each_token_from_its_row() {
    let prompt = periodic_prompt(1);
    let run_with = |logprobs| {
        let mut run = Run::new(config(4, 512, 8), 512);
        run.kv.model = soft;
        let params = SamplingParams {
            max_tokens: 6,
            logprobs,
            ..SamplingParams::default()
        };
        let mut rx = run.submit_params(0, prompt.clone(), params, ROOM);
        run.run_to_end();
        let mut got = Vec::new();
        while let Ok(e) = rx.try_recv() {
            if let Event::Token(t, l) = e {
                got.push((t, l));
            }
        }
        (got, run.device_steps)
    };
    let (plain, device) = run_with(None);
    assert!(device > 0 && plain.iter().all(|(_, l)| l.is_none()));
    let (with, device) = run_with(Some(2));
    assert!(
        device > 0,
        "log-probabilities come with the device's tokens"
    );
    assert_eq!(with.len(), plain.len());
    let mut ctx = prompt.clone();
    for ((t, l), (plain_t, _)) in with.iter().zip(&plain) {
        assert_eq!(t, plain_t);
        let l = l.as_ref().expect("asked for");
        assert_eq!(**l, crate::sampling::logprobs(&soft(&ctx), *t, 2));
        ctx.push(*t);
    }
}

/// A grammar for the tests: tokens alternate between even and odd (never 0, the
/// end-of-sequence id), the output may end after 3 of them and is complete after `len`.
#[derive(Debug)]
struct Alternating {
    accepted: usize,
    len: usize,
}

impl constraint::Constraint for Alternating {
    fn allowed(&mut self) -> Result<constraint::Allowed, String> {
        let mut words = vec![0u32; VOCAB.div_ceil(32)];
        if self.accepted < self.len {
            for t in (1..VOCAB).filter(|t| t % 2 == self.accepted % 2) {
                words[t / 32] |= 1 << (t % 32);
            }
        }
        Ok(constraint::Allowed {
            words,
            may_end: self.accepted >= 3,
        })
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        if token as usize % 2 != self.accepted % 2 || token == 0 {
            return Err(format!("token {token} at {}", self.accepted));
        }
        self.accepted += 1;
        Ok(())
    }

    fn is_complete(&self) -> bool {
        self.accepted >= self.len
    }
}

/// Constrained requests sample on the device under their masks (no rows of logits come
/// back) and follow the grammar to its end, greedy and sampled, batched with free ones;
/// with drafts they verify on the host against masked rows, and greedy gives the same
/// tokens either way.
#[test]
fn constrained_rows_are_masked_on_the_device_and_follow_the_grammar() {
    let run_with = |cfg: SchedulerConfig| {
        let mut run = Run::new(cfg, 512);
        run.kv.model = soft;
        let mut rxs = Vec::new();
        for i in 0..6u64 {
            let (tx, rx) = channel(ROOM);
            run.sched.add(Submission {
                id: i,
                prompt: periodic_prompt(i as u32),
                params: SamplingParams {
                    max_tokens: 30,
                    temperature: if i < 3 { 0.0 } else { 0.7 },
                    seed: i,
                    ..SamplingParams::default()
                },
                session: None,
                events: tx,
                ended_by_client: Default::default(),
                constraint: (i % 3 != 2).then(|| {
                    Box::new(Alternating {
                        accepted: 0,
                        len: 5 + i as usize,
                    }) as Box<dyn constraint::Constraint>
                }),
            });
            rxs.push(rx);
        }
        run.run_to_end();
        let outcomes: Vec<_> = rxs.iter_mut().map(outcome).collect();
        (outcomes, run.device_steps, run.logit_steps)
    };
    let (device, device_steps, logit_steps) = run_with(config(4, 512, 8));
    assert!(
        device_steps > 0 && logit_steps == 0,
        "{logit_steps} steps read logits"
    );
    for (i, (tokens, usage)) in device.iter().enumerate() {
        assert!(usage.is_some(), "request {i} finished");
        if i % 3 == 2 {
            continue; // free
        }
        assert!(
            (3..=5 + i).contains(&tokens.len()),
            "request {i}: {tokens:?} is as long as the grammar allows"
        );
        for (k, t) in tokens.iter().enumerate() {
            assert_eq!(*t as usize % 2, k % 2, "request {i}: {tokens:?}");
        }
    }
    let (drafted, _, logit_steps) = run_with(speculative(config(4, 512, 8), 3));
    assert!(logit_steps > 0, "drafts verified from rows of logits");
    for i in 0..3 {
        assert_eq!(drafted[i].0, device[i].0, "greedy request {i}");
    }
}
