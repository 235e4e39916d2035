//! Host-side engine overhead (criterion, CPU only): the prefix cache's match + insert of a
//! 100k-token request among 1,000 cached sessions, and one scheduling step of 256 running
//! decode requests. Targets (issue 5): < 1 ms and < 200 us, so a GPU step of a few
//! milliseconds never waits on the host. A step in which 64 requests are found to wait
//! for a running 100k-token prefill that shares their prefix (admission's added work). And drafting (issue 27): each drafter's (n-gram,
//! suffix) work for one request per step at a 100k-token context, < 50 us; and its first proposal
//! for a request, which indexes the whole context once, or, for an agent's next turn, takes
//! the previous turn's index over and indexes only the new tokens.
//!
//! Sessions share an 8k-token system prompt and then diverge; each timed request is one
//! session's next turn (its cached history plus 512 new tokens), so the tree grows as a
//! real agent workload's does. The scheduling step samples from 64-wide logits: sampling
//! over a full vocabulary is the device's job, not the scheduler's (see RESULTS.md).
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kiln::cache::{PagePool, PrefixCache, RadixCache};
use kiln::metrics::Metrics;
use kiln::scheduler::{Event, SamplingParams, Scheduler, SchedulerConfig, Scores, Submission};
use kiln::speculative::{Drafter, IndexedNgramDrafter, SuffixDrafter};
use kiln_core::rng::Rng;
use tokio::sync::mpsc::Receiver;

const PAGE: usize = 64;
const SESSIONS: usize = 1000;
const SHARED: usize = 8192;
const CONTEXT: usize = 100_000;
const TURN: usize = 512;

fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(160_000) as u32).collect()
}

/// A cache of `SESSIONS` 100k-token sessions and each session's tokens.
fn cached_sessions() -> (RadixCache, PagePool, Vec<Vec<u32>>) {
    let mut rng = Rng::new(7);
    let system = tokens(&mut rng, SHARED);
    let budget = SESSIONS * (CONTEXT / PAGE + 2 * TURN);
    let (mut cache, mut pool) = (RadixCache::new(PAGE), PagePool::new(budget));
    let sessions: Vec<Vec<u32>> = (0..SESSIONS)
        .map(|_| {
            let mut s = system.clone();
            s.extend(tokens(&mut rng, CONTEXT - SHARED));
            serve(&mut cache, &mut pool, &s);
            s
        })
        .collect();
    (cache, pool, sessions)
}

/// One request as the scheduler runs it against the cache (which has no host tier here):
/// lookup, new pages for the rest, insert, release.
fn serve(cache: &mut RadixCache, pool: &mut PagePool, request: &[u32]) -> usize {
    let hit = cache.lookup(request).device;
    pool.retain(&hit);
    let full = request.len() / PAGE;
    let new = pool
        .alloc(full - hit.len())
        .expect("the pool is sized for the run");
    let pages: Vec<u32> = hit.iter().chain(&new).copied().collect();
    cache.insert(&request[..full * PAGE], &pages, pool);
    pool.release(&pages);
    hit.len()
}

fn radix(c: &mut Criterion) {
    let (mut cache, mut pool, mut sessions) = cached_sessions();
    let mut rng = Rng::new(11);
    let mut next = 0;
    c.bench_function(
        "radix match+insert, 100k-token turn among 1000 sessions",
        |b| {
            b.iter_batched(
                || {
                    let s = &mut sessions[next % SESSIONS];
                    next += 1;
                    s.extend(tokens(&mut rng, TURN));
                    s.clone()
                },
                |request| serve(&mut cache, &mut pool, &request),
                BatchSize::LargeInput,
            )
        },
    );
}

/// A scheduler over `pages` pages of [`PAGE`] tokens (a radix cache, no speculation) with
/// steps of `max_batch_tokens`.
fn scheduler(max_batch_tokens: usize, pages: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        page_size: PAGE,
        max_batch_tokens,
        max_running: 256,
        context_len: 1 << 20,
        eos_token_ids: vec![],
        stall_timeout: std::time::Duration::from_secs(60),
        speculative: None,
    };
    let cache = Box::new(RadixCache::new(PAGE));
    Scheduler::new(cfg, pages, cache, Arc::new(Metrics::default()))
}

/// Queues request `id` (`prompt`, up to `max_tokens` out); the receiver of its events.
fn submit(sched: &mut Scheduler, id: u64, prompt: Vec<u32>, max_tokens: usize) -> Receiver<Event> {
    let (events, rx) = tokio::sync::mpsc::channel(kiln::scheduler::EVENT_BUFFER);
    sched.add(Submission {
        id,
        prompt,
        params: SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        },
        session: None,
        events,
        ended_by_client: Default::default(),
        constraint: None,
    });
    rx
}

fn scheduling(c: &mut Criterion) {
    const VOCAB: usize = 64;
    // Room for every request to grow by criterion's iterations without preemption.
    let mut sched = scheduler(2048, 256 * 4096);
    let mut rng = Rng::new(3);
    let mut receivers: Vec<_> = (0..256)
        .map(|id| {
            let prompt = tokens(&mut rng, 2000)
                .iter()
                .map(|t| t % VOCAB as u32)
                .collect();
            submit(&mut sched, id, prompt, 1 << 20)
        })
        .collect();
    // Prefill everyone (2048-token steps) until all 256 decode.
    let logits = vec![0.5f32; 256 * VOCAB];
    while sched.decoding() < 256 {
        let step = sched.schedule().expect("work");
        let rows = step.batch.requests.len();
        sched.complete(step, Scores::Logits(&logits[..rows * VOCAB], VOCAB));
        // Read the tokens as clients do: a full channel pauses its request.
        for rx in &mut receivers {
            while rx.try_recv().is_ok() {}
        }
    }
    c.bench_function("scheduling step, 256 running decode requests", |b| {
        b.iter(|| {
            let step = sched.schedule().expect("work");
            assert_eq!(step.batch.requests.len(), 256, "{}", sched.describe());
            sched.complete(step, Scores::Logits(&logits, VOCAB));
            for rx in &mut receivers {
                while rx.try_recv().is_ok() {}
            }
        })
    });
}

/// A scheduler whose one running request prefills a 100k-token prompt in 8k-token chunks,
/// all but the last done, and `waiting` requests, queued after it, that extend its first
/// 99k tokens by 512 of their own (an agent's parallel calls on one history). Its next
/// step leaves room in the budget, so admission looks at them: they share pages of the
/// last chunk, which the cache does not hold yet, so each waits.
/// Its requests' receivers come with it, so none counts as gone.
fn waiting_on_a_prefill(waiting: usize) -> (Scheduler, Vec<Receiver<Event>>) {
    let mut sched = scheduler(8192, (waiting + 1) * (CONTEXT / PAGE + 16));
    let mut rng = Rng::new(5);
    let history = tokens(&mut rng, CONTEXT);
    let mut receivers = vec![submit(&mut sched, 0, history.clone(), 16)];
    for _ in 0..CONTEXT / 8192 {
        step(&mut sched);
    }
    for id in 1..=waiting as u64 {
        let mut prompt = history[..CONTEXT - 1000].to_vec();
        prompt.extend(tokens(&mut rng, TURN));
        receivers.push(submit(&mut sched, id, prompt, 16));
    }
    (sched, receivers)
}

/// One step: planned, and completed with a row of logits for each request.
fn step(sched: &mut Scheduler) {
    let step = sched.schedule().expect("work");
    let rows = step.batch.requests.len();
    assert_eq!(rows, 1, "only the prefill runs: {}", sched.describe());
    sched.complete(step, Scores::Logits(&vec![0.5; rows * 64], 64));
}

/// Admission while requests wait for a running prefill of their prefix: the step in which
/// each is looked at (a cache lookup and a comparison with the prefill's prompt).
fn admission(c: &mut Criterion) {
    c.bench_function(
        "scheduling step, 64 requests found to wait for a 100k-token prefill",
        |b| {
            b.iter_batched(
                || waiting_on_a_prefill(64),
                // Returned, so criterion drops it outside the timing.
                |(mut s, receivers)| {
                    step(&mut s);
                    (s, receivers)
                },
                BatchSize::LargeInput,
            )
        },
    );
}

/// A 100k-token agent context: code-like text, tokens drawn from a 2,000-token working
/// vocabulary so n-grams recur as they do in quoted files and tool output.
fn agent_context(rng: &mut Rng) -> Vec<u32> {
    (0..CONTEXT).map(|_| rng.below(2000) as u32).collect()
}

/// Tokens a request grows by in the steady-state bench before it starts over from the
/// 100k-token context (so the context stays near 100k however many iterations run).
const WINDOW: usize = 16_384;

fn drafting(c: &mut Criterion) {
    let mut rng = Rng::new(5);
    let context = agent_context(&mut rng);
    let mut next_turn = context.clone();
    next_turn.extend((0..TURN).map(|_| rng.below(2000) as u32));
    drafter_benches(
        c,
        "ngram",
        IndexedNgramDrafter::default,
        &context,
        &next_turn,
    );
    drafter_benches(c, "suffix", SuffixDrafter::default, &context, &next_turn);
}

/// One drafter's first proposal for a 100k-token request, for an agent's next turn (the
/// previous turn's index retained and taken over, so only its new 512 tokens are
/// indexed), and its steady-state step; drafts of up to 16 tokens (the suffix drafter's
/// trees grow to as many nodes as its paths' scores allow).
fn drafter_benches<D: Drafter>(
    c: &mut Criterion,
    name: &str,
    new: fn() -> D,
    context: &[u32],
    next_turn: &[u32],
) {
    const DRAFT: usize = 16;
    c.bench_function(
        &format!("{name} drafting, first proposal of a 100k-token request"),
        |b| {
            // The drafter is returned, so that dropping it is not timed.
            b.iter_batched(
                new,
                |mut d| (d.propose(0, context, DRAFT), d),
                BatchSize::LargeInput,
            )
        },
    );
    let ended = || {
        let mut d = new();
        d.propose(0, context, DRAFT);
        d.finished(0);
        d
    };
    c.bench_function(
        &format!("{name} drafting, first proposal of a next turn (100k + 512 tokens)"),
        |b| {
            b.iter_batched(
                ended,
                |mut d| (d.propose(1, next_turn, DRAFT), d),
                BatchSize::LargeInput,
            )
        },
    );
    // Steady state: each step the request grows by what the last one emitted (1 to
    // DRAFT + 1 tokens) and drafts again; past WINDOW tokens it starts over (untimed).
    let mut rng = Rng::new(9);
    let (mut drafter, mut tokens) = (new(), context.to_vec());
    drafter.propose(0, &tokens, DRAFT);
    c.bench_function(
        &format!("{name} drafting, one request's step at a 100k-token context"),
        |b| {
            b.iter_custom(|iters| {
                let mut timed = std::time::Duration::ZERO;
                for _ in 0..iters {
                    if tokens.len() > context.len() + WINDOW {
                        (drafter, tokens) = (new(), context.to_vec());
                        drafter.propose(0, &tokens, DRAFT);
                    }
                    let emitted = 1 + rng.below(DRAFT + 1);
                    tokens.extend((0..emitted).map(|_| rng.below(2000) as u32));
                    let start = std::time::Instant::now();
                    std::hint::black_box(drafter.propose(0, &tokens, DRAFT));
                    timed += start.elapsed();
                }
                timed
            })
        },
    );
}

criterion_group!(benches, radix, scheduling, admission, drafting);
criterion_main!(benches);
