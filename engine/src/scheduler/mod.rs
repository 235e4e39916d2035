//! Continuous batching with chunked prefill over a paged KV pool and a prefix cache.
//!
//! Each step: every running request that is decoding gets its one token first (decode is
//! never starved by a long prefill), then running prefills continue in chunks, then waiting
//! requests are admitted (prefix-cache lookup first) while the step's token budget and the
//! running limit allow. While requests wait, the prefills' chunks leave half the budget for
//! them and are lengthened by what admission leaves (a short request is not held behind a
//! long prefill's chunks). When pages run out: evict unused cached prefixes, then preempt the
//! newest running request (its computed pages go to the prefix cache, so coming back is
//! mostly a cache hit). The oldest request is never preempted for a newer one, and every
//! admitted request fits the pool alone, so some request always makes progress. A request
//! whose pages cannot be had that way evicts nothing (`pages.rs`).
//!
//! A prefill's whole pages go to the prefix cache chunk by chunk, and a waiting request
//! whose prompt shares more whole pages with a running prefill than the cache gives it
//! yet waits for that prefill instead of computing the same prefix beside it (requests
//! behind it that share nothing go ahead).
//!
//! Host-side only: [`Scheduler::schedule`] returns a [`Step`] (a model [`Batch`], whose
//! rows carry how each is sampled on the device), [`Scheduler::complete`] takes its tokens,
//! or its rows of logits where a sampled or constrained request's draft needs them
//! (verification weighs the whole distribution). With the overlapped schedule,
//! [`Scheduler::advance`] books a step as run before its tokens are known (placeholders the
//! next step reads on the device) and `complete` fills them in. Speculative decoding: a
//! decoding request's
//! slice may end in a draft tree ([`Draft`]); `computed` then advances only by the accepted
//! tokens whose cache rows are in place (the path `0, 1, 2, ..` of the tree) and the rest,
//! accepted or not, are rewritten by the next step.
mod admission;
mod complete;
pub mod constraint;
mod pages;
pub mod policy;
mod request;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use complete::{Logprobs, Scores};
pub use request::{
    Event, FinishReason, SamplingParams, Submission, TokenLogprobs, Usage, EVENT_BUFFER,
};
use request::{Request, UNRESOLVED};

use crate::cache::{KvCopy, PagePool, PrefixCache};
use crate::metrics::{Metrics, PolicyDecision};
use crate::model::gpu::{Batch, LogitRows, RequestSlice};
use crate::speculative::policy::{draft_budgets, Acceptance, StepCosts};
use crate::speculative::{
    draft_len, simulated_accepts, Draft, DraftPolicy, Drafter, SpecConfig, ROOT,
};

/// Limits the scheduler works within.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub page_size: usize,
    /// Token budget of one step: decode tokens plus prefill chunks.
    pub max_batch_tokens: usize,
    /// Most requests in the running batch.
    pub max_running: usize,
    /// The model's context length.
    pub context_len: usize,
    pub eos_token_ids: Vec<u32>,
    /// How long a running request may wait on a client that reads none of its output
    /// before it is aborted (see [`EVENT_BUFFER`]).
    pub stall_timeout: Duration,
    /// Speculative decoding (`None`: one token per request a step).
    pub speculative: Option<SpecConfig>,
}

/// The work of one step: the batch and which request each slice belongs to, and the KV
/// copies between the cache's tiers to apply, in order, before it runs.
#[derive(Debug)]
pub struct Step {
    pub batch: Batch,
    slices: Vec<Slice>,
    pub copies: Vec<KvCopy>,
    /// [`Scheduler::advance`] ran: its requests' KV counts and placeholders are in place.
    advanced: bool,
    /// The draft policy gave drafts to requests whose last token was still on the device
    /// (a drafter reads known tokens): the step after this one must have its tokens.
    drafts_wanted: bool,
}

impl Step {
    /// Whether every request in it runs only its last token (and any draft): no prompt
    /// tokens.
    pub fn is_decode(&self) -> bool {
        self.slices.iter().all(|s| s.decode)
    }

    /// Whether [`Scheduler::advance`] booked it as run.
    pub fn is_advanced(&self) -> bool {
        self.advanced
    }

    /// A decode step's requests and the tokens it runs (theirs and their drafts), which
    /// its time is recorded under ([`Scheduler::observe_step`]); `None` for other steps.
    pub fn decode_shape(&self) -> Option<(usize, usize)> {
        let rows = self.slices.iter().map(|s| s.tokens + s.draft.len()).sum();
        self.is_decode().then_some((self.slices.len(), rows))
    }
}

/// One request's part of a step.
#[derive(Debug)]
struct Slice {
    id: u64,
    /// Tokens of the request's own it runs (prefill chunk, or its last token).
    tokens: usize,
    /// It runs only its last, generated token (and the draft).
    decode: bool,
    /// It runs the last of its prompt.
    prompt_done: bool,
    /// Drafted tokens run after them, to verify (each gets a logits row, as does the last
    /// of the request's own, the tree's root).
    draft: Draft,
}

/// Waiting and running requests, the page pool and the prefix cache.
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: PagePool,
    cache: Box<dyn PrefixCache>,
    waiting: VecDeque<Request>,
    /// In admission order: earlier requests have priority.
    running: Vec<Request>,
    metrics: Arc<Metrics>,
    drafter: Option<Box<dyn Drafter>>,
    /// Decode steps' measured times, and the acceptance of all requests' drafts lately
    /// (what each request's own estimate leans on), for the draft policy.
    costs: StepCosts,
    acceptance: Acceptance,
}

impl Scheduler {
    /// A scheduler over `num_pages` pages.
    pub fn new(
        cfg: SchedulerConfig,
        num_pages: usize,
        cache: Box<dyn PrefixCache>,
        metrics: Arc<Metrics>,
    ) -> Self {
        assert!(cfg.max_batch_tokens >= cfg.max_running && cfg.max_running > 0);
        metrics.kv_total_pages.set(num_pages as f64);
        let drafter = cfg.speculative.map(|s| s.drafter.build());
        Scheduler {
            drafter,
            cfg,
            pool: PagePool::new(num_pages),
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics,
            costs: StepCosts::default(),
            acceptance: Acceptance::geometric(0.5),
        }
    }

    /// A decode step of shape `(requests, tokens)` ([`Step::decode_shape`]) took
    /// `seconds`, what it added to the run (planning to sampling, or from the step before's
    /// tokens where it overlapped that step): what the draft policy sizes drafts by.
    pub fn observe_step(&mut self, (requests, rows): (usize, usize), seconds: f64) {
        self.costs.observe(requests, rows, seconds);
    }

    /// Tokens the pool holds.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.total() * self.cfg.page_size
    }

    /// Queues a request (the caller checked it fits: see [`policy::fits_pool`]).
    pub fn add(&mut self, s: Submission) {
        tracing::debug!(id = s.id, session = ?s.session, prompt = s.prompt.len(), "queued");
        self.waiting.push_back(Request::new(s));
        self.publish();
    }

    /// Running requests whose next step is a decode (one token).
    pub fn decoding(&self) -> usize {
        self.running.iter().filter(|r| r.decodes()).count()
    }

    /// Whether nothing is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Drops requests whose clients went away, freeing their pages: aborted, unless the
    /// client ended them as complete (a stop string), which counts as finished.
    pub fn abort_cancelled(&mut self) {
        let before = self.waiting.len() + self.running.len();
        let drafter = &mut self.drafter;
        self.waiting.retain(|r| {
            let gone = r.cancelled();
            if let (true, Some(d)) = (gone, drafter.as_mut()) {
                d.finished(r.id); // a preempted request may have drafted
            }
            !gone
        });
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| r.cancelled());
        self.running = kept;
        let ended = gone.iter().filter(|r| r.ended_by_client()).count();
        for r in gone {
            tracing::debug!(id = r.id, ended = r.ended_by_client(), "client closed");
            self.retire(r);
        }
        let closed = before - self.waiting.len() - self.running.len();
        self.metrics.requests_finished.add(ended as u64);
        self.metrics.requests_aborted.add((closed - ended) as u64);
        if closed > 0 {
            self.publish();
        }
    }

    /// Aborts running requests whose clients have read nothing for `stall_timeout`: they
    /// learn why through the slot their channel keeps for the end, and their pages are
    /// freed (computed pages stay in the prefix cache).
    pub fn abort_stalled(&mut self, now: Instant) {
        let timeout = self.cfg.stall_timeout;
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|r| r.stalled_since.is_some_and(|t| now - t >= timeout));
        self.running = kept;
        if gone.is_empty() {
            return;
        }
        for r in gone {
            tracing::warn!(id = r.id, session = ?r.session, generated = r.generated(), "client stalled, aborting");
            r.send(Event::Failed(format!(
                "the client read none of the output for {} s; the request was aborted",
                timeout.as_secs_f64()
            )));
            self.retire(r);
            self.metrics.requests_aborted.add(1);
        }
        self.publish();
    }

    /// Plans the next step; `None` if there is nothing to run. A request whose client
    /// has no room for the next token is left out (paused) until it reads; it keeps its
    /// pages, but its slot goes to a waiting request (`max_running` counts the others).
    pub fn schedule(&mut self) -> Option<Step> {
        let now = Instant::now();
        for r in &mut self.running {
            match (r.can_send(), r.stalled_since) {
                (true, _) => r.stalled_since = None,
                (false, None) => r.stalled_since = Some(now),
                (false, Some(_)) => {}
            }
        }
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<usize> = vec![0; self.running.len()];
        let mut drafts: Vec<Draft> = vec![Draft::default(); self.running.len()];
        let decoding = self.decoding();
        let (limits, drafts_wanted) = self.draft_limits(decoding, now);
        // A running request left out for lack of pages: newcomers must not take them.
        let mut starved = false;
        // Decode first, then prefill chunks, each in admission order. While requests wait,
        // the chunks of prefills in progress leave half the budget to admit them (a warm
        // turn does not queue behind a cold 100k-token prefill); what admission leaves goes
        // back to those chunks after it.
        let mut held = 0;
        for decode_pass in [true, false] {
            if !decode_pass && !self.waiting.is_empty() {
                held = budget / 2;
                budget -= held;
            }
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let pending = self.running[i].pending();
                let paused = self.running[i].stalled_since.is_some()
                    || self.running[i].ends_when_resolved(self.cfg.context_len);
                if plan[i] == 0 && !paused && self.running[i].decodes() == decode_pass {
                    let draft = match decode_pass {
                        true => self.draft(i, decoding, budget, limits[i]),
                        false => Draft::default(),
                    };
                    let want = policy::chunk_len(pending, budget) + draft.len();
                    match self.plan_one(i, want, &mut plan) {
                        Some(n) => {
                            plan[i] = n;
                            budget -= n;
                            // Pages short of the whole draft: what fits of it.
                            drafts[i] = draft.prefix(n.saturating_sub(pending));
                        }
                        None => starved = true,
                    }
                }
                i += 1;
            }
        }
        drafts.truncate(self.running.len());
        if let Some(d) = &self.drafter {
            self.metrics.spec_drafter_bytes.set(d.memory_bytes() as f64);
        }
        budget += held;
        // A paused request keeps its pages but not its slot in the batch.
        let active =
            |running: &[Request]| running.iter().filter(|r| r.stalled_since.is_none()).count();
        while !starved && budget > 0 && active(&self.running) < self.cfg.max_running {
            let Some(n) = self.admit(budget) else { break };
            plan.push(n);
            budget -= n;
        }
        if held > 0 {
            self.extend_chunks(&mut plan, budget);
        }
        self.publish();
        drafts.resize(self.running.len(), Draft::default());
        let (mut requests, mut slices) = (Vec::new(), Vec::new());
        // How each logits row is drawn on the device; only a sampled request's draft needs
        // its rows of logits back (verification weighs the whole distribution).
        let mut sampling = Some(Vec::new());
        // The most alternatives a request's log-probabilities list, when one asks for them.
        let mut top = None;
        // Tokens laid out so far, and the ones the previous step samples on the device.
        let (mut laid_out, mut from_previous) = (0, Vec::new());
        // Rows of logits so far, and the masks of constrained rows drawn on the device.
        let (mut rows, mut masks) = (0, Vec::new());
        let eos = &self.cfg.eos_token_ids;
        for ((r, &n), draft) in self.running.iter_mut().zip(&plan).zip(drafts) {
            if n == 0 {
                continue;
            }
            let row = r.sampling_row(r.tokens.len());
            top = top.max(r.params.logprobs);
            let own = n - draft.len();
            if r.constraint.is_some() && own == r.pending() {
                // It samples this step: on the device under its mask, unless it drafted
                // (its draft is verified against masked rows on the host).
                match draft.is_empty() {
                    true => {
                        if let Some(a) = complete::allowed(r) {
                            masks.push((rows, a.bits(&complete::stops(r, eos))));
                        }
                    }
                    false => sampling = None,
                }
            }
            if row.is_sampled() && !draft.is_empty() {
                sampling = None;
            }
            rows += 1 + draft.len();
            if let Some(rows) = sampling.as_mut() {
                rows.extend(std::iter::repeat_n(row, 1 + draft.len()));
            }
            let kv_len = r.computed + n;
            let mut tokens = r.tokens[r.computed..r.computed + own].to_vec();
            if let Some(row) = r.unresolved {
                // Only the last token is unresolved, and it is the one the slice runs.
                debug_assert_eq!((own, r.pending()), (1, 1));
                from_previous.push((laid_out, row));
                tokens[0] = 0;
            }
            tokens.extend(&draft.tokens);
            laid_out += tokens.len();
            requests.push(RequestSlice {
                tokens,
                kv_len,
                block_table: r.pages[..kv_len.div_ceil(self.cfg.page_size)].to_vec(),
                // A chain needs no mask: causal attention is its tree's.
                tree: (!draft.is_chain()).then(|| draft.rooted_parents()),
            });
            slices.push(Slice {
                id: r.id,
                tokens: own,
                decode: r.decodes() && own == r.pending(),
                prompt_done: r.computed < r.prompt_len && r.computed + own >= r.prompt_len,
                draft,
            });
        }
        if requests.is_empty() {
            return None;
        }
        let mut batch = Batch::last_logits(requests);
        // Log-probabilities come from the device with the tokens (at least one alternative
        // a row, so no buffer is empty).
        batch.logprobs = top.filter(|_| sampling.is_some()).map(|t| t.max(1));
        if sampling.is_some() {
            batch.masks = masks;
        }
        batch.sampling = sampling;
        batch.from_previous = from_previous;
        if slices.iter().any(|s| !s.draft.is_empty()) {
            batch.logits = LogitRows::Tails(slices.iter().map(|s| 1 + s.draft.len()).collect());
        }
        let copies = self.cache.take_copies();
        for c in &copies {
            match c {
                KvCopy::ToHost { .. } => self.metrics.kv_pages_to_host.add(1),
                KvCopy::ToDevice { .. } => self.metrics.kv_pages_to_device.add(1),
            }
        }
        Some(Step {
            batch,
            slices,
            copies,
            advanced: false,
            drafts_wanted,
        })
    }

    /// Whether `step` may be [advanced](Self::advance) before its tokens are known: it
    /// samples every row on the device and nothing about the step after it depends on
    /// its tokens but their ids (no drafts to verify, none the draft policy wants next, no
    /// hidden states, no grammar whose next mask follows the token). With speculation on,
    /// the steps where the policy drafts nothing overlap as they do without it.
    pub fn can_overlap(&self, step: &Step) -> bool {
        let b = &step.batch;
        !step.drafts_wanted
            && step.slices.iter().all(|s| s.draft.is_empty())
            && b.sampling.is_some()
            && b.capture.is_empty()
            && b.masks.is_empty()
    }

    /// Books `step` as run before its tokens are read, so the next step can be planned
    /// while the device runs it: each request's KV count moves past the tokens it runs,
    /// and a request whose sample this is gets a placeholder last token, which the next
    /// step reads on the device ([`Batch::from_previous`]) and [`Self::complete`] fills
    /// in. Requests that left since `step` was planned are skipped.
    pub fn advance(&mut self, step: &mut Step) {
        assert!(self.can_overlap(step) && !step.advanced);
        step.advanced = true;
        for (row, slice) in step.slices.iter().enumerate() {
            let Some(r) = self.running.iter_mut().find(|r| r.id == slice.id) else {
                continue;
            };
            r.computed += slice.tokens;
            if r.pending() == 0 {
                r.tokens.push(UNRESOLVED);
                r.unresolved = Some(row);
            }
        }
    }

    /// Most tokens each running request drafts this step: none unless it decodes; else
    /// its limits ([`draft_len`] within the whole step's budget) and, within them, what
    /// the draft policy gives it (nothing in a step that measures the plain step again).
    /// A request whose last token is still on the device drafts nothing; the flag says
    /// the policy gave one of those a draft.
    fn draft_limits(&mut self, decoding: usize, now: Instant) -> (Vec<usize>, bool) {
        let mut limits = vec![0; self.running.len()];
        let Some(spec) = self.cfg.speculative else {
            return (limits, false);
        };
        let decodes: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].decodes() && self.running[i].stalled_since.is_none())
            .collect();
        let most: Vec<usize> = decodes
            .iter()
            .map(|&i| {
                let room = self.running[i].events.capacity();
                draft_len(spec.max_draft, decoding, self.cfg.max_batch_tokens, room)
            })
            .collect();
        let b = decodes.len();
        let given = match spec.policy {
            DraftPolicy::Fixed => most,
            DraftPolicy::Measured if b == 0 => Vec::new(),
            DraftPolicy::Measured => {
                let decision = if self.costs.probe_plain(b, now) {
                    PolicyDecision::Probe
                } else if self.costs.estimate(b, b, now).is_none() {
                    PolicyDecision::Unmeasured
                } else {
                    PolicyDecision::NoGain
                };
                let mut given = vec![0; b];
                if decision == PolicyDecision::NoGain {
                    let gains: Vec<Vec<f64>> = (decodes.iter().zip(most))
                        .map(|(&i, most)| self.running[i].acceptance.gains(&self.acceptance, most))
                        .collect();
                    let costs = &self.costs;
                    given = draft_budgets(&gains, |rows| costs.estimate(b, rows, now));
                }
                let decision = match given.iter().any(|&n| n > 0) {
                    true => PolicyDecision::Draft,
                    false => decision,
                };
                self.metrics.spec_policy_steps[decision as usize].add(1);
                given
            }
        };
        let mut wanted = false;
        for (i, n) in decodes.into_iter().zip(given) {
            let r = &mut self.running[i];
            match (n, r.unresolved) {
                // No news of its drafts this step: its own estimate fades toward all
                // requests', so acceptance that returns can be tried again.
                (0, _) => r.acceptance.fade(),
                (_, Some(_)) => wanted = true,
                (n, None) => limits[i] = n,
            }
        }
        (limits, wanted)
    }

    /// A draft of at most `most` tokens for decoding request `i` (empty when speculation
    /// is off or cannot pay).
    fn draft(&mut self, i: usize, decoding: usize, budget: usize, most: usize) -> Draft {
        let (Some(spec), Some(drafter)) = (self.cfg.speculative, self.drafter.as_mut()) else {
            return Draft::default();
        };
        let r = &self.running[i];
        let room = r.events.capacity();
        // The budget past its pending tokens but one: `draft_len` keeps a token for that one.
        let budget = budget.saturating_sub(r.pending().saturating_sub(1));
        let max = draft_len(spec.max_draft, decoding, budget, room).min(most);
        if max == 0 {
            return Draft::default();
        }
        let mut draft = drafter.propose(r.id, &r.tokens, max);
        draft.truncate(max);
        draft
    }

    /// A request leaves: its computed pages go to the cache, its references are dropped,
    /// the drafter forgets it.
    fn retire(&mut self, mut r: Request) {
        if let Some(d) = self.drafter.as_mut() {
            d.finished(r.id);
        }
        cache_computed(&mut *self.cache, &mut self.pool, self.cfg.page_size, &mut r);
        self.pool.release(&r.pages);
    }

    /// A one-line account of the queue, the batch and the pool, for logs and test failures.
    pub fn describe(&self) -> String {
        let running: Vec<_> = (self.running.iter())
            .map(|r| (r.id, r.computed, r.tokens.len(), r.pages.len()))
            .collect();
        let waiting: Vec<_> = self
            .waiting
            .iter()
            .map(|r| (r.id, r.tokens.len()))
            .collect();
        format!(
            "running (id, computed, tokens, pages) {running:?}; waiting (id, tokens) {waiting:?}; \
             pages free {} cached {} total {}",
            self.pool.free_pages(),
            self.cache.cached_pages(),
            self.pool.total()
        )
    }

    /// Checks that every page reference is accounted for by a request or the cache.
    #[cfg(test)]
    pub(crate) fn check_pages(&self) {
        let (refs, cached) = self.pool.totals();
        let held: usize = self.running.iter().map(|r| r.pages.len()).sum();
        assert_eq!(
            cached,
            self.cache.cached_pages(),
            "cache holds vs its own count"
        );
        assert_eq!(
            refs,
            held + cached,
            "references vs holders: {}",
            self.describe()
        );
    }

    /// Publishes the gauges.
    fn publish(&self) {
        let m = &self.metrics;
        m.running.set(self.running.len() as f64);
        m.queued.set(self.waiting.len() as f64);
        m.kv_usage
            .set(self.pool.request_pages() as f64 / self.pool.total().max(1) as f64);
        m.kv_cached_pages.set(self.cache.cached_pages() as f64);
        m.kv_host_pages.set(self.cache.host_pages() as f64);
    }
}

/// Puts the whole pages of `r`'s computed tokens into the prefix cache and switches `r` to
/// the cache's pages where it computed a prefix the cache already had.
fn cache_computed(
    cache: &mut dyn PrefixCache,
    pool: &mut PagePool,
    page_size: usize,
    r: &mut Request,
) {
    let full = r.computed / page_size;
    let cached = cache.insert(&r.tokens[..full * page_size], &r.pages[..full], pool);
    r.in_cache = full;
    for (mine, theirs) in r.pages.iter_mut().zip(cached) {
        if *mine != theirs {
            pool.retain(&[theirs]);
            pool.release(&[*mine]);
            *mine = theirs;
        }
    }
}

#[cfg(test)]
mod tests;
