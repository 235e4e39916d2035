//! The scheduler driven by a stand-in model that keeps a real paged KV store on the host:
//! each step writes the slice's tokens into the pages of its block table, reads the whole
//! context back through the block table and answers with a token that hashes that context.
//! A wrong page, a stale cached prefix or a lost token therefore changes the output, so
//! "the same tokens as running alone" checks paging, prefix reuse and preemption together.
use std::collections::HashMap;

use proptest::prelude::*;
use tokio::sync::mpsc::{channel, Receiver};

use super::*;
use crate::cache::CacheKind;

const VOCAB: usize = 50;

struct HostKv {
    page_size: usize,
    rows: Vec<Option<u32>>,
}

impl HostKv {
    fn new(page_size: usize, pages: usize) -> Self {
        HostKv {
            page_size,
            rows: vec![None; page_size * pages],
        }
    }

    /// Runs a step: one-hot logits per slice.
    fn step(&mut self, batch: &Batch) -> Vec<f32> {
        let mut logits = vec![0.0; batch.requests.len() * VOCAB];
        for (b, r) in batch.requests.iter().enumerate() {
            let slot = |pos: usize| {
                r.block_table[pos / self.page_size] as usize * self.page_size + pos % self.page_size
            };
            let first = r.kv_len - r.tokens.len();
            for (i, &t) in r.tokens.iter().enumerate() {
                self.rows[slot(first + i)] = Some(t);
            }
            let hash = (0..r.kv_len).fold(17u64, |h, pos| {
                let t = self.rows[slot(pos)].expect("every position read was written");
                h.wrapping_mul(31).wrapping_add(t as u64 + 1)
            });
            logits[b * VOCAB + (hash % VOCAB as u64) as usize] = 1.0;
        }
        logits
    }
}

fn config(page_size: usize, budget: usize, max_running: usize) -> SchedulerConfig {
    SchedulerConfig {
        page_size,
        max_batch_tokens: budget,
        max_running,
        context_len: 10_000,
        eos_token_ids: vec![0],
        stall_timeout: Duration::from_secs(3600),
    }
}

/// Room for every event of the tests' requests: they read outcomes after running.
const ROOM: usize = 1 << 16;

struct Run {
    sched: Scheduler,
    kv: HostKv,
    metrics: Arc<Metrics>,
}

impl Run {
    fn new(cfg: SchedulerConfig, pages: usize) -> Self {
        let metrics = Arc::new(Metrics::default());
        let kv = HostKv::new(cfg.page_size, pages);
        let cache = CacheKind::Radix.build(cfg.page_size);
        Run {
            sched: Scheduler::new(cfg, pages, cache, metrics.clone()),
            kv,
            metrics,
        }
    }

    fn submit(&mut self, id: u64, prompt: Vec<u32>, max_tokens: usize) -> Receiver<Event> {
        self.submit_with_room(id, prompt, max_tokens, ROOM)
    }

    fn submit_with_room(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        max_tokens: usize,
        room: usize,
    ) -> Receiver<Event> {
        let (tx, rx) = channel(room);
        self.sched.add(Submission {
            id,
            prompt,
            params: SamplingParams {
                max_tokens,
                ..SamplingParams::default()
            },
            session: None,
            events: tx,
            ended_by_client: Default::default(),
        });
        rx
    }

    /// Runs one step; returns its batch's slice lengths.
    fn step(&mut self) -> Option<Vec<usize>> {
        self.sched.abort_cancelled();
        let step = self.sched.schedule()?;
        self.sched.check_pages();
        let lens = step.batch.requests.iter().map(|r| r.tokens.len()).collect();
        let logits = self.kv.step(&step.batch);
        self.sched.complete(step, &logits, VOCAB);
        self.sched.check_pages();
        Some(lens)
    }

    fn run_to_end(&mut self) {
        let mut steps = 0;
        while self.step().is_some() {
            steps += 1;
            assert!(steps < 100_000, "the scheduler does not finish");
        }
        assert!(self.sched.is_idle(), "stuck: {}", self.sched.describe());
    }
}

/// Tokens and the finish event of a request, from its channel.
fn outcome(rx: &mut Receiver<Event>) -> (Vec<u32>, Option<Usage>) {
    let (mut tokens, mut usage) = (Vec::new(), None);
    while let Ok(e) = rx.try_recv() {
        match e {
            Event::Token(t) => tokens.push(t),
            Event::Finished { usage: u, .. } => usage = Some(u),
            Event::Admitted { .. } => {}
            Event::Failed(why) => panic!("failed: {why}"),
        }
    }
    (tokens, usage)
}

fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut run = Run::new(config(4, 4096, 8), 4096);
    let mut rx = run.submit(0, prompt.to_vec(), max_tokens);
    run.run_to_end();
    outcome(&mut rx).0
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
        prompts in prop::collection::vec(
            (prop::collection::vec(1u32..4, 1..60), 1usize..20), 1..12),
        shared in prop::collection::vec(1u32..4, 0..40),
    ) {
        // Every request must fit the pool alone; sharing a prefix makes cache hits likely.
        let mut run = Run::new(config(page_size, budget, 8), pages);
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
    let mut run = Run::new(config(4, 64, 16), 40);
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
    let mut seen = HashMap::new();
    for (rx, p) in rxs.iter_mut().zip(&prompts) {
        let got = outcome(rx).0;
        assert_eq!(&got, seen.entry(p.clone()).or_insert_with(|| alone(p, 40)));
    }
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
