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
use crate::speculative::DrafterKind;

const VOCAB: usize = 50;

/// A stand-in model: the logits of the next token after a context.
type Model = fn(&[u32]) -> Vec<f32>;

struct HostKv {
    page_size: usize,
    rows: Vec<Option<u32>>,
    /// The prefix cache's host tier: a page's rows by slot.
    slots: HashMap<u32, Vec<Option<u32>>>,
    model: Model,
    /// Request slices that ended in a draft tree (not a chain).
    trees: usize,
}

fn context_hash(ctx: &[u32]) -> u64 {
    ctx.iter()
        .fold(17u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1))
}

/// One-hot on a hash of the whole context.
fn hashed(ctx: &[u32]) -> Vec<f32> {
    let mut logits = vec![0.0; VOCAB];
    logits[(context_hash(ctx) % VOCAB as u64) as usize] = 1.0;
    logits
}

/// The tokens of period [`PERIOD`], so n-gram drafts of a periodic prompt are accepted.
const PERIOD: usize = 7;

/// One-hot on the token [`PERIOD`] back (a model that repeats its context).
fn periodic(ctx: &[u32]) -> Vec<f32> {
    let mut logits = vec![0.0; VOCAB];
    logits[ctx[ctx.len().saturating_sub(PERIOD)] as usize] = 30.0;
    logits
}

/// Soft logits: the token [`PERIOD`] back is likely (about half the mass), the rest spread
/// by a hash of the context, so sampled drafts are sometimes kept and sometimes not.
fn soft(ctx: &[u32]) -> Vec<f32> {
    let h = context_hash(ctx);
    let mut logits: Vec<f32> = (0..VOCAB as u64)
        .map(|t| ((h ^ t.wrapping_mul(0x9e37_79b9)) % 7) as f32 * 0.3)
        .collect();
    logits[ctx[ctx.len().saturating_sub(PERIOD)] as usize] += 4.5;
    logits
}

impl HostKv {
    fn new(page_size: usize, pages: usize) -> Self {
        HostKv {
            page_size,
            rows: vec![None; page_size * pages],
            slots: HashMap::new(),
            model: hashed,
            trees: 0,
        }
    }

    /// Applies a step's copies between the tiers, in order, as the engine does.
    fn copy(&mut self, copies: &[KvCopy]) {
        let rows = |page: u32| page as usize * self.page_size..(page as usize + 1) * self.page_size;
        for &c in copies {
            match c {
                KvCopy::ToHost { page, slot } => {
                    self.slots.insert(slot, self.rows[rows(page)].to_vec());
                }
                KvCopy::ToDevice { slot, page } => {
                    let range = rows(page);
                    self.rows[range].copy_from_slice(&self.slots[&slot]);
                }
            }
        }
    }

    /// Runs a step: the model's logits at each row the batch asks for, from the context
    /// read back through the block table.
    fn step(&mut self, batch: &Batch) -> Vec<f32> {
        let mut logits = Vec::new();
        for (b, r) in batch.requests.iter().enumerate() {
            let slot = |pos: usize| {
                r.block_table[pos / self.page_size] as usize * self.page_size + pos % self.page_size
            };
            let first = r.kv_len - r.tokens.len();
            for (i, &t) in r.tokens.iter().enumerate() {
                self.rows[slot(first + i)] = Some(t);
            }
            let ctx: Vec<u32> = (0..r.kv_len)
                .map(|pos| self.rows[slot(pos)].expect("every position read was written"))
                .collect();
            let rows = match &batch.logits {
                LogitRows::All => r.tokens.len(),
                LogitRows::Last => 1,
                LogitRows::Tails(n) => n[b],
            };
            // A draft tree's node sees the context before the tree and its ancestors.
            self.trees += usize::from(r.tree.is_some());
            let tree = r.tree.as_deref().unwrap_or(&[-1]);
            let start = r.kv_len - tree.len();
            for pos in r.kv_len - rows..r.kv_len {
                let mut seen = ctx[..pos.min(start)].to_vec();
                if pos >= start {
                    let mut path = Vec::new();
                    let mut node = (pos - start) as i32;
                    while node >= 0 {
                        path.push(ctx[start + node as usize]);
                        node = tree[node as usize];
                    }
                    seen.extend(path.iter().rev());
                } else {
                    seen.push(ctx[pos]);
                }
                logits.extend((self.model)(&seen));
            }
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
        speculative: None,
    }
}

/// Room for every event of the tests' requests: they read outcomes after running.
const ROOM: usize = 1 << 16;

/// Seconds a decode step of shape `(requests, tokens)` takes, for the draft policy.
type StepCost = fn((usize, usize)) -> f64;

struct Run {
    sched: Scheduler,
    kv: HostKv,
    metrics: Arc<Metrics>,
    /// Each decode step's time as the engine would measure it (none: not observed).
    cost: Option<StepCost>,
    /// Steps that drew their tokens on the device, and steps that read logits back.
    device_steps: usize,
    logit_steps: usize,
}

impl Run {
    fn new(cfg: SchedulerConfig, pages: usize) -> Self {
        Self::tiered(cfg, pages, 0)
    }

    /// With a host tier of `host_slots` pages.
    fn tiered(cfg: SchedulerConfig, pages: usize, host_slots: usize) -> Self {
        let metrics = Arc::new(Metrics::default());
        let kv = HostKv::new(cfg.page_size, pages);
        let cache = CacheKind::Radix.build(cfg.page_size, host_slots);
        Run {
            sched: Scheduler::new(cfg, pages, cache, metrics.clone()),
            kv,
            metrics,
            cost: None,
            device_steps: 0,
            logit_steps: 0,
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
        let params = SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        };
        self.submit_params(id, prompt, params, room)
    }

    fn submit_params(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        params: SamplingParams,
        room: usize,
    ) -> Receiver<Event> {
        let (tx, rx) = channel(room);
        self.sched.add(Submission {
            id,
            prompt,
            params,
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
        self.kv.copy(&step.copies);
        let logits = self.kv.step(&step.batch);
        let shape = step.decode_shape();
        // A step that samples on the device gets each row's token as the oracle draws it.
        let ids: Vec<u32> = match &step.batch.sampling {
            Some(rows) => logits
                .chunks(VOCAB)
                .zip(rows)
                .map(|(l, r)| kiln_reference::sampling::draw(l, r).token)
                .collect(),
            None => Vec::new(),
        };
        let scores = match step.batch.sampling {
            Some(_) => {
                self.device_steps += 1;
                Scores::Tokens(&ids)
            }
            None => {
                self.logit_steps += 1;
                Scores::Logits(&logits, VOCAB)
            }
        };
        self.sched.complete(step, scores);
        if let (Some(shape), Some(cost)) = (shape, self.cost) {
            self.sched.observe_step(shape, cost(shape));
        }
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
        host_slots in prop_oneof![Just(0usize), 1usize..64],
        prompts in prop::collection::vec(
            (prop::collection::vec(1u32..4, 1..60), 1usize..20), 1..12),
        shared in prop::collection::vec(1u32..4, 0..40),
    ) {
        // Every request must fit the pool alone; sharing a prefix makes cache hits likely.
        let mut run = Run::tiered(config(page_size, budget, 8), pages, host_slots);
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

fn speculative(cfg: SchedulerConfig, max_draft: usize) -> SchedulerConfig {
    SchedulerConfig {
        speculative: Some(SpecConfig {
            drafter: crate::speculative::DrafterKind::Ngram,
            max_draft,
            policy: crate::speculative::DraftPolicy::Fixed,
            simulated_accept_len: None,
        }),
        ..cfg
    }
}

/// Tokens of each prompt run together on `cfg` over `pages` pages with `model`, and the
/// usage of each.
fn run_all(
    cfg: SchedulerConfig,
    pages: usize,
    model: Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Vec<u32>>, Vec<Usage>, Arc<Metrics>) {
    run_costed(cfg, pages, model, prompts, max_tokens, None)
}

/// [`run_all`] with each decode step's time observed as `cost` says.
fn run_costed(
    cfg: SchedulerConfig,
    pages: usize,
    model: Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    cost: Option<StepCost>,
) -> (Vec<Vec<u32>>, Vec<Usage>, Arc<Metrics>) {
    let mut run = Run::new(cfg, pages);
    run.kv.model = model;
    run.cost = cost;
    let mut rxs: Vec<_> = (0..prompts.len())
        .map(|i| run.submit(i as u64, prompts[i].clone(), max_tokens))
        .collect();
    run.run_to_end();
    let (tokens, usage) = rxs
        .iter_mut()
        .map(|rx| {
            let (t, u) = outcome(rx);
            (t, u.expect("finished"))
        })
        .unzip();
    (tokens, usage, run.metrics)
}

fn periodic_prompt(offset: u32) -> Vec<u32> {
    (0..3 * PERIOD as u32)
        .map(|i| 1 + (i + offset) % PERIOD as u32)
        .collect()
}

#[test]
fn greedy_speculation_gives_the_same_tokens_in_fewer_steps() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
    let drafters = [DrafterKind::Ngram, DrafterKind::Suffix];
    for ((model, predictable), drafter) in [(periodic as Model, true), (hashed, false)]
        .into_iter()
        .flat_map(|m| drafters.map(|d| (m, d)))
    {
        let (plain, _, m0) = run_all(cfg.clone(), 512, model, &prompts, 40);
        let mut cfg = speculative(cfg.clone(), 4);
        cfg.speculative = cfg.speculative.map(|s| SpecConfig { drafter, ..s });
        let (spec, usage, m1) = run_all(cfg, 512, model, &prompts, 40);
        assert_eq!(plain, spec, "speculation changed greedy tokens");
        assert!(m1.spec_drafted_tokens.get() > 0);
        // The accept-length histogram holds one observation per verify step with a
        // draft: the tokens it emitted, accepted drafts and the model's own.
        let lengths = &m1.spec_accept_length;
        assert!(lengths.count() > 0);
        let accepted = lengths.sum() - lengths.count() as f64;
        assert_eq!(accepted, m1.spec_accepted_tokens.get() as f64);
        if predictable {
            // Every draft of a repeating model is right: about 5 tokens a step.
            assert!(
                m1.steps.get() * 3 < m0.steps.get(),
                "{} vs {} steps",
                m1.steps.get(),
                m0.steps.get()
            );
            assert!(
                usage.iter().all(|u| u.spec_accepted_tokens >= 30),
                "{usage:?}"
            );
        }
    }
}

/// [`speculative`] with drafts sized by the measured policy.
fn measured(cfg: SchedulerConfig, max_draft: usize) -> SchedulerConfig {
    let mut cfg = speculative(cfg, max_draft);
    cfg.speculative = cfg.speculative.map(|s| SpecConfig {
        policy: crate::speculative::DraftPolicy::Measured,
        ..s
    });
    cfg
}

/// 10 ms a decode step, and 0.1 ms per drafted token (verification nearly free).
fn cheap((requests, rows): (usize, usize)) -> f64 {
    0.010 + 0.0001 * (rows - requests) as f64
}

/// 10 ms a decode step, and 1 ms per drafted token: drafts of high acceptance pay, of low
/// acceptance do not.
fn moderate((requests, rows): (usize, usize)) -> f64 {
    0.010 + 0.001 * (rows - requests) as f64
}

/// 10 ms a decode step, and 10 ms per request's worth of drafted tokens (verifying a
/// draft costs as much as the tokens it could save).
fn dear((requests, rows): (usize, usize)) -> f64 {
    0.010 * rows as f64 / requests as f64
}

#[test]
fn the_measured_policy_drafts_only_where_verification_pays() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..4).map(periodic_prompt).collect();
    let (plain, _, m0) = run_all(cfg.clone(), 512, periodic, &prompts, 60);
    // Right drafts, cheap verification: it drafts, in far fewer steps.
    let (spec, _, m) = run_costed(
        measured(cfg.clone(), 4),
        512,
        periodic,
        &prompts,
        60,
        Some(cheap),
    );
    assert_eq!(plain, spec, "speculation changed greedy tokens");
    assert!(
        m.steps.get() * 2 < m0.steps.get(),
        "{} vs {}",
        m.steps.get(),
        m0.steps.get()
    );
    // Right drafts, dear verification: one step tries drafts (a size not yet measured),
    // then it stops.
    let (spec, _, m) = run_costed(
        measured(cfg.clone(), 4),
        512,
        periodic,
        &prompts,
        60,
        Some(dear),
    );
    assert_eq!(plain, spec);
    assert!(
        m.spec_drafted_tokens.get() <= 16,
        "{}",
        m.spec_drafted_tokens.get()
    );
    // The policy's decisions, counted by kind: a first step with nothing timed, probes of
    // the plain step, one try, then no gain.
    let decided = |d: PolicyDecision| m.spec_policy_steps[d as usize].get();
    assert!(decided(PolicyDecision::Unmeasured) + decided(PolicyDecision::Probe) >= 1);
    assert!(
        decided(PolicyDecision::Draft) <= 4,
        "{}",
        decided(PolicyDecision::Draft)
    );
    assert!(
        decided(PolicyDecision::NoGain) > 10,
        "{}",
        decided(PolicyDecision::NoGain)
    );
    // Wrong drafts, verification at 10% of a step per token: acceptance falls and
    // drafting stops, where the fixed policy drafts all along.
    let (plain, _, _) = run_all(cfg.clone(), 512, hashed, &prompts, 60);
    let (fixed, _, mf) = run_all(speculative(cfg.clone(), 4), 512, hashed, &prompts, 60);
    let (spec, _, m) = run_costed(measured(cfg, 4), 512, hashed, &prompts, 60, Some(moderate));
    assert_eq!(plain, fixed);
    assert_eq!(plain, spec);
    let (drafted, fixed_drafted) = (m.spec_drafted_tokens.get(), mf.spec_drafted_tokens.get());
    assert!(drafted * 4 < fixed_drafted, "{drafted} vs {fixed_drafted}");
}

#[test]
fn the_measured_policy_drafts_as_deep_as_drafts_are_accepted() {
    // Simulated acceptance at 4 keeps 3 of 5 drafted tokens, every step: once measured,
    // the policy drafts 3 (the 4th and 5th never pay) and each verify step still emits 4.
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let mut cfg = measured(cfg, 5);
    cfg.speculative = cfg.speculative.map(|s| SpecConfig {
        drafter: crate::speculative::DrafterKind::Simulated,
        simulated_accept_len: Some(4.0),
        ..s
    });
    let prompts: Vec<Vec<u32>> = (0..6).map(periodic_prompt).collect();
    let (_, _, m) = run_costed(cfg, 1024, hashed, &prompts, 400, Some(moderate));
    let lengths = &m.spec_accept_length;
    let verified = lengths.count() as f64;
    let drafted = m.spec_drafted_tokens.get() as f64 / verified;
    assert!(drafted < 3.3, "{drafted} drafted a verify step");
    assert!(
        lengths.sum() / verified > 3.8,
        "{}",
        lengths.sum() / verified
    );
}

#[test]
fn simulated_acceptance_emits_the_set_length_per_verify_step() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..6).map(periodic_prompt).collect();
    for len in [1.0, 2.5, 4.0] {
        let mut cfg = speculative(cfg.clone(), 4);
        cfg.speculative = cfg.speculative.map(|s| SpecConfig {
            drafter: crate::speculative::DrafterKind::Simulated,
            simulated_accept_len: Some(len),
            ..s
        });
        // The simulation, not the model, decides what a verify step keeps.
        let (out, usage, m) = run_all(cfg, 512, hashed, &prompts, 200);
        assert!(out.iter().all(|t| t.len() == 200), "max_tokens still holds");
        assert!(usage.iter().all(|u| u.completion_tokens == 200));
        let lengths = &m.spec_accept_length;
        let mean = lengths.sum() / lengths.count() as f64;
        assert!((mean - len).abs() < 0.1, "{len}: {mean}");
    }
}

#[test]
fn speculation_through_preemption_and_chunked_prefill_keeps_the_tokens() {
    let mut cfg = config(4, 24, 6);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..12)
        .map(|i| {
            let mut p = periodic_prompt(i);
            p.extend((0..i * 5).map(|t| 1 + (t * 7 + i) % 40));
            p
        })
        .collect();
    let (plain, _, _) = run_all(cfg.clone(), 4096, periodic, &prompts, 30);
    // A pool that holds about three requests: preemption with drafts in flight.
    let (spec, _, m) = run_all(speculative(cfg, 3), 48, periodic, &prompts, 30);
    assert_eq!(plain, spec);
    assert!(m.preemptions.get() > 0, "the pool was meant to preempt");
    assert!(m.spec_accepted_tokens.get() > 0);
}

#[test]
fn stop_tokens_and_max_tokens_inside_an_accepted_draft_end_it_there() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids = vec![5]; // the periodic prompt's fifth token
    let prompts = vec![periodic_prompt(0)];
    let (plain, pu, _) = run_all(cfg.clone(), 512, periodic, &prompts, 40);
    let (spec, su, _) = run_all(speculative(cfg.clone(), 4), 512, periodic, &prompts, 40);
    assert_eq!(plain, spec);
    assert_eq!(pu[0].completion_tokens, su[0].completion_tokens);
    assert!(!spec[0].contains(&5) && spec[0].len() < 40, "{spec:?}");
    cfg.eos_token_ids.clear();
    for max in [1, 2, 6, 9] {
        let (spec, _, _) = run_all(speculative(cfg.clone(), 4), 512, periodic, &prompts, max);
        assert_eq!(spec[0].len(), max);
    }
}

/// Drafts a tree that puts the periodic model's continuation behind a wrong sibling: the
/// root's children are (wrong, right), right's child is the next right token, the wrong
/// one has a child too. Verification takes the second child, so the accepted path's rows
/// are out of place and the next step rewrites them.
struct DecoyTree;

impl Drafter for DecoyTree {
    fn propose(&mut self, _id: u64, tokens: &[u32], max: usize) -> Draft {
        let n = tokens.len();
        if max < 4 || n < PERIOD {
            return Draft::default();
        }
        let wrong = |t: u32| 1 + t % (VOCAB as u32 - 1);
        let (right, next) = (tokens[n - PERIOD], tokens[n - PERIOD + 1]);
        Draft {
            tokens: vec![wrong(right), right, next, wrong(next)],
            parents: vec![ROOT, ROOT, 1, 0],
        }
    }
}

#[test]
fn a_tree_whose_accepted_path_is_out_of_place_gives_the_same_tokens() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
    let (plain, _, m0) = run_all(cfg.clone(), 512, periodic, &prompts, 40);
    let mut run = Run::new(speculative(cfg, 4), 512);
    run.kv.model = periodic;
    run.sched.drafter = Some(Box::new(DecoyTree));
    let mut rxs: Vec<_> = (0..prompts.len())
        .map(|i| run.submit(i as u64, prompts[i].clone(), 40))
        .collect();
    run.run_to_end();
    let spec: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| outcome(rx).0).collect();
    assert_eq!(plain, spec, "a tree changed greedy tokens");
    assert!(run.kv.trees > 0, "trees reached the model");
    assert!(run.device_steps > 0, "greedy steps read token ids back");
    // Two drafted tokens and the model's own a step.
    let m = &run.metrics;
    assert!(
        m.steps.get() * 2 < m0.steps.get(),
        "{} vs {}",
        m.steps.get(),
        m0.steps.get()
    );
    let lengths = &m.spec_accept_length;
    assert!(lengths.sum() / lengths.count() as f64 > 2.5);
}

/// Out-of-place accepted tokens leave several pending: their draft still fits the step's
/// token budget, however small it is.
#[test]
fn drafts_after_out_of_place_tokens_fit_a_small_step_budget() {
    for budget in [5, 6, 7, 9] {
        let mut cfg = config(4, budget, 4);
        cfg.eos_token_ids.clear();
        let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
        let (plain, _, _) = run_all(cfg.clone(), 512, periodic, &prompts, 30);
        let mut run = Run::new(speculative(cfg, 4), 512);
        run.kv.model = periodic;
        run.sched.drafter = Some(Box::new(DecoyTree));
        let mut rxs: Vec<_> = (0..prompts.len())
            .map(|i| run.submit(i as u64, prompts[i].clone(), 30))
            .collect();
        run.run_to_end();
        let spec: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| outcome(rx).0).collect();
        assert_eq!(plain, spec, "budget {budget}");
        assert!(run.kv.trees > 0, "budget {budget}: trees reached the model");
    }
}

/// `P(tokens[pos] = t)` over the model's own sampling, computed exactly from the model.
fn exact_marginal(model: Model, prompt: &[u32], pos: usize) -> Vec<f64> {
    fn probs(model: Model, ctx: &[u32]) -> Vec<f64> {
        let l = model(ctx);
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = l.iter().map(|&x| (x as f64 - max).exp()).collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }
    let mut paths = vec![(prompt.to_vec(), 1.0)];
    for _ in 0..pos {
        paths = paths
            .into_iter()
            .flat_map(|(ctx, p)| {
                probs(model, &ctx)
                    .into_iter()
                    .enumerate()
                    .map(move |(t, q)| {
                        let mut c = ctx.clone();
                        c.push(t as u32);
                        (c, p * q)
                    })
            })
            .filter(|(_, p)| *p > 1e-12)
            .collect();
    }
    let mut out = vec![0.0; VOCAB];
    for (ctx, p) in paths {
        for (t, q) in probs(model, &ctx).into_iter().enumerate() {
            out[t] += p * q;
        }
    }
    out
}

/// Sampled speculation is lossless: the third generated token (after two verified steps)
/// is distributed as the model's own sampling says, by a chi-square test at p = 0.001 over
/// 20,000 requests (tokens binned by id mod 11).
#[test]
fn sampled_speculation_emits_the_distribution_of_plain_sampling() {
    for tree in [false, true] {
        sampled_speculation_is_lossless(tree);
    }
}

/// Chains of the n-gram drafter, or [`DecoyTree`]'s trees (two children to verify at the
/// root).
fn sampled_speculation_is_lossless(tree: bool) {
    let mut cfg = speculative(config(4, 512, 16), 4);
    cfg.eos_token_ids.clear();
    let mut run = Run::new(cfg, 4096);
    run.kv.model = soft;
    if tree {
        run.sched.drafter = Some(Box::new(DecoyTree));
    }
    let prompt = periodic_prompt(0);
    let (trials, bins) = (20_000usize, 11usize);
    let mut counts = vec![0usize; bins];
    for round in 0..trials / 16 {
        let mut rxs: Vec<_> = (0..16)
            .map(|i| {
                let id = (round * 16 + i) as u64;
                let params = SamplingParams {
                    max_tokens: 3,
                    temperature: 1.0,
                    seed: id * 7919 + 1,
                    ..SamplingParams::default()
                };
                run.submit_params(id, prompt.clone(), params, ROOM)
            })
            .collect();
        run.run_to_end();
        for rx in &mut rxs {
            let tokens = outcome(rx).0;
            counts[tokens[2] as usize % bins] += 1;
        }
    }
    assert!(
        run.metrics.spec_accepted_tokens.get() > 1000,
        "drafts were verified"
    );
    assert!(
        run.metrics.spec_accepted_tokens.get() < run.metrics.spec_drafted_tokens.get(),
        "and some rejected"
    );
    let exact = exact_marginal(soft, &prompt, 2);
    let mut want = vec![0.0; bins];
    for (t, p) in exact.iter().enumerate() {
        want[t % bins] += p;
    }
    let fit = kiln_reference::stats::chi_square(&counts, &want);
    assert!(
        fit.statistic < kiln_reference::stats::critical_value_p001(fit.dof),
        "tree {tree}: {counts:?} vs {want:?}: {fit:?}"
    );
    assert_eq!(run.kv.trees > 0, tree);
    assert!(run.logit_steps > 0, "sampled drafts read logits back");
}
