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
use crate::model::gpu::RowLogprobs;
use crate::speculative::DrafterKind;
use kiln_kernels::sample::NO_TOKEN;

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
    /// Leave steps whose tokens are drawn on the device in flight while the next is
    /// planned, as the engine does with overlap on; steps that read tokens of the step
    /// before on the device.
    overlap: bool,
    in_flight: Option<(Step, Ran)>,
    fed_steps: usize,
}

/// What a step computed: its rows of logits, the tokens drawn from them where the step
/// samples on the device, and their log-probabilities where it asks.
struct Ran {
    logits: Vec<f32>,
    ids: Vec<u32>,
    logprobs: Option<RowLogprobs>,
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
            overlap: false,
            in_flight: None,
            fed_steps: 0,
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
            constraint: None,
        });
        rx
    }

    /// Runs one step; returns its batch's slice lengths (none: a step in flight ended).
    fn step(&mut self) -> Option<Vec<usize>> {
        self.sched.abort_cancelled();
        let Some(mut step) = self.sched.schedule() else {
            let (step, ran) = self.in_flight.take()?;
            self.complete(step, ran);
            return Some(Vec::new());
        };
        self.sched.check_pages();
        let lens = step.batch.requests.iter().map(|r| r.tokens.len()).collect();
        self.kv.copy(&step.copies);
        let ran = self.run_batch(&step.batch);
        if let Some((before, ran)) = self.in_flight.take() {
            self.complete(before, ran);
        }
        if self.overlap && self.sched.can_overlap(&step) {
            self.sched.advance(&mut step);
            self.in_flight = Some((step, ran));
        } else {
            self.complete(step, ran);
        }
        self.sched.check_pages();
        Some(lens)
    }

    /// The stand-in device running `batch`: its tokens fed from the step in flight's
    /// where it says, then its rows, and the tokens and log-probabilities the oracle draws.
    fn run_batch(&mut self, batch: &Batch) -> Ran {
        let mut batch = batch.clone();
        if !batch.from_previous.is_empty() {
            self.fed_steps += 1;
            let previous = &self.in_flight.as_ref().expect("a step in flight").1.ids;
            let mut slots: Vec<&mut u32> = batch
                .requests
                .iter_mut()
                .flat_map(|r| &mut r.tokens)
                .collect();
            for &(at, row) in &batch.from_previous {
                *slots[at] = previous[row];
            }
        }
        let logits = self.kv.step(&batch);
        // A step that samples on the device gets each row's token as the oracle draws it,
        // from the row under its mask where it has one.
        let ids: Vec<u32> = match &batch.sampling {
            Some(rows) => (logits.chunks(VOCAB).zip(rows).enumerate())
                .map(|(i, (l, r))| {
                    let mask = batch.masks.iter().find(|(row, _)| *row == i);
                    let l = mask.map_or(l.to_vec(), |(_, bits)| {
                        kiln_reference::sampling::masked(l, bits)
                    });
                    kiln_reference::sampling::draw(&l, r).token
                })
                .collect(),
            None => Vec::new(),
        };
        // And their log-probabilities, as the oracle gives them, when the step asks.
        let logprobs = batch.logprobs.map(|top| {
            let rows: Vec<_> = (logits.chunks(VOCAB).zip(&ids))
                .map(|(l, &t)| kiln_reference::sampling::logprobs(l, t, top))
                .collect();
            let pad = |best: &[(u32, f64)]| {
                let mut b: Vec<(u32, f32)> = best.iter().map(|&(i, v)| (i, v as f32)).collect();
                b.resize(top, (NO_TOKEN, f32::NEG_INFINITY));
                b
            };
            let listed: Vec<(u32, f32)> = rows.iter().flat_map(|(_, b)| pad(b)).collect();
            let token: Vec<f32> = rows.iter().map(|(t, _)| *t as f32).collect();
            let (ids, values): (Vec<u32>, Vec<f32>) = listed.into_iter().unzip();
            RowLogprobs {
                token,
                top,
                ids,
                values,
            }
        });
        Ran {
            logits,
            ids,
            logprobs,
        }
    }

    /// Hands a step's outputs to the scheduler, as the engine does.
    fn complete(&mut self, step: Step, ran: Ran) {
        let shape = step.decode_shape();
        let scores = match step.batch.sampling {
            Some(_) => {
                self.device_steps += 1;
                let lp = ran.logprobs.as_ref().map(|l| Logprobs {
                    token: &l.token,
                    top: l.top,
                    ids: &l.ids,
                    values: &l.values,
                });
                Scores::Tokens(&ran.ids, lp)
            }
            None => {
                self.logit_steps += 1;
                Scores::Logits(&ran.logits, VOCAB)
            }
        };
        self.sched.complete(step, scores);
        if let (Some(shape), Some(cost)) = (shape, self.cost) {
            self.sched.observe_step(shape, cost(shape));
        }
    }

    /// Submits every prompt (ids in order), runs to the end; each one's tokens and usage.
    fn all(&mut self, prompts: &[Vec<u32>], max_tokens: usize) -> (Vec<Vec<u32>>, Vec<Usage>) {
        let mut rxs: Vec<_> = (prompts.iter().enumerate())
            .map(|(i, p)| self.submit(i as u64, p.clone(), max_tokens))
            .collect();
        self.run_to_end();
        rxs.iter_mut()
            .map(|rx| {
                let (t, u) = outcome(rx);
                (t, u.expect("finished"))
            })
            .unzip()
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
            Event::Token(t, _) => tokens.push(t),
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
    let (tokens, usage) = run.all(prompts, max_tokens);
    (tokens, usage, run.metrics)
}

fn periodic_prompt(offset: u32) -> Vec<u32> {
    (0..3 * PERIOD as u32)
        .map(|i| 1 + (i + offset) % PERIOD as u32)
        .collect()
}

mod serving;
mod speculation;
