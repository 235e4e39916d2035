//! A request as the scheduler sees it: its tokens, how far its KV is computed, its pages,
//! its sampling parameters and the channel its events go to.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kiln_core::rng::Rng;
use kiln_core::sampling::SamplingRow;
use tokio::sync::mpsc::Sender;

use super::constraint::Constraint;
use crate::speculative::policy::Acceptance;

/// How to pick tokens and when to stop.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f32,
    /// Filters on the distribution (`kiln_core::sampling`): nucleus (the tokens whose
    /// larger-logit tokens hold less than `top_p`), the `top_k` largest (0: all), and those of
    /// at least `min_p` times the largest probability (0: all).
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    /// Seed of this request's sampler (the same seed gives the same tokens).
    pub seed: u64,
    /// Token ids that end the generation (besides the model's end-of-sequence ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating through end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many most likely
    /// alternatives (`None`: none). Its steps read rows of logits back.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens`, or the model's context is full.
    Length,
}

impl FinishReason {
    /// The name OpenAI's API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// With speculation on: decode steps (each verifies a draft, maybe empty: SGLang's
    /// `spec_verify_ct`), and the drafted tokens they accepted.
    pub spec_verify_ct: usize,
    pub spec_accepted_tokens: usize,
}

/// What the engine tells a request's client, in order: tokens, then one `Finished`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The prompt was admitted; this much of it came from the cache.
    Admitted { cached_tokens: usize },
    /// A generated token, with its log-probabilities when the request asked for them.
    Token(u32, Option<Box<TokenLogprobs>>),
    /// The end. The stop token that ended it (if any) is not among the tokens.
    Finished { reason: FinishReason, usage: Usage },
    /// The request cannot run (e.g. the device failed); nothing more follows.
    Failed(String),
}

/// A generated token's log-probability under the model (the log-softmax of its raw
/// logits, before temperature and filters, as OpenAI and vLLM report it) and the most likely
/// tokens' at its position, most likely first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Events a request's channel holds that its client has not read. The engine never blocks
/// on a client: a request whose channel lacks room for a token and its end pauses (keeps
/// its pages, leaves the batch) until the client reads, and is aborted if it does not read
/// for the scheduler's `stall_timeout`. So a request's unread output is bounded.
pub const EVENT_BUFFER: usize = 64;

/// A request submitted to the engine.
#[derive(Debug)]
pub struct Submission {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The `x-session-id` it came with, for the logs.
    pub session: Option<String>,
    /// Bounded ([`EVENT_BUFFER`]); the engine only `try_send`s on it.
    pub events: Sender<Event>,
    /// Set by the client before it drops its receiver when the request ended on its side
    /// (its text reached a stop string): counted as finished, not aborted.
    pub ended_by_client: Arc<AtomicBool>,
    /// What its output must match (a JSON schema's grammar), if anything.
    pub constraint: Option<Box<dyn Constraint>>,
}

/// A request inside the scheduler.
#[derive(Debug)]
pub(crate) struct Request {
    pub id: u64,
    pub session: Option<String>,
    /// Prompt, then every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub params: SamplingParams,
    pub rng: Rng,
    /// Block table: pages holding positions `0..computed` (and room for the next chunk).
    pub pages: Vec<u32>,
    /// Tokens whose KV is in `pages`.
    pub computed: usize,
    /// Leading whole pages of `pages` that the prefix cache holds too.
    pub in_cache: usize,
    /// Prompt tokens the cache supplied at first admission (`None` until admitted).
    pub cached: Option<usize>,
    pub events: Sender<Event>,
    pub ended_by_client: Arc<AtomicBool>,
    pub constraint: Option<Box<dyn Constraint>>,
    pub arrived: Instant,
    pub last_token_at: Option<Instant>,
    /// Since when the client has left no room for the next token (`None`: it reads).
    pub stalled_since: Option<Instant>,
    /// Steps that verified a draft of this request, and the drafted tokens accepted.
    pub spec_verify_ct: usize,
    pub spec_accepted: usize,
    /// How its drafted tokens fared lately, by depth (the draft policy's input).
    pub acceptance: Acceptance,
    /// `Some(row)`: its last token was sampled on the device at this row of the step in
    /// flight and is not known here yet (`tokens` ends in [`UNRESOLVED`] in its place).
    pub unresolved: Option<usize>,
    /// The running request whose prefill of its prefix it waits for, and the whole pages
    /// they share (while it waits).
    pub waits_for: Option<(u64, usize)>,
}

/// The id a request's last token has in `tokens` until its step's tokens are read
/// ([`Request::unresolved`]).
pub(crate) const UNRESOLVED: u32 = u32::MAX;

impl Request {
    pub fn new(s: Submission) -> Self {
        Request {
            id: s.id,
            session: s.session,
            prompt_len: s.prompt.len(),
            tokens: s.prompt,
            rng: Rng::new(s.params.seed),
            params: s.params,
            pages: Vec::new(),
            computed: 0,
            in_cache: 0,
            cached: None,
            events: s.events,
            ended_by_client: s.ended_by_client,
            constraint: s.constraint,
            arrived: Instant::now(),
            last_token_at: None,
            stalled_since: None,
            spec_verify_ct: 0,
            spec_accepted: 0,
            acceptance: Acceptance::default(),
            unresolved: None,
            waits_for: None,
        }
    }

    /// Whether the channel has room for a token and the end after it (the last slot is
    /// kept for the end, so a paused request can always be told why it ended), besides the
    /// unresolved token's.
    pub fn can_send(&self) -> bool {
        self.events.capacity() >= 2 + usize::from(self.unresolved.is_some())
    }

    /// Whether its unresolved last token is its last: it can run no more.
    pub fn ends_when_resolved(&self, context_len: usize) -> bool {
        self.unresolved.is_some()
            && (self.generated() >= self.params.max_tokens || self.tokens.len() >= context_len)
    }

    /// Sends `event`; the caller made sure there is room (a full channel drops it).
    pub fn send(&self, event: Event) {
        let _ = self.events.try_send(event);
    }

    /// How the token at `position` is drawn.
    pub fn sampling_row(&self, position: usize) -> SamplingRow {
        let p = &self.params;
        SamplingRow {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            seed: p.seed,
            position: position as u32,
        }
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether its next step decodes: it has generated, and what it still has to run is
    /// its last token and at most the accepted draft tokens whose cache rows a tree
    /// verification left out of place (so a draft tree fits after them).
    pub fn decodes(&self) -> bool {
        self.generated() > 0
            && self.computed >= self.prompt_len
            && self.pending() <= kiln_kernels::mla::MAX_TREE_NODES
    }

    /// Whether the client went away (its receiver is dropped).
    pub fn cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// Whether the client ended the request as complete (a stop string) rather than left.
    pub fn ended_by_client(&self) -> bool {
        self.ended_by_client.load(Ordering::Acquire)
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached.unwrap_or(0),
            completion_tokens: self.generated(),
            spec_verify_ct: self.spec_verify_ct,
            spec_accepted_tokens: self.spec_accepted,
        }
    }
}
