//! Closed-loop coding-agent sessions: the model and its seeded generator.
//!
//! A [`Session`] is a chain of [`Turn`]s. Turn `t` sends the whole history (the shared
//! system prompt, then every earlier turn's new input and output on the main line) plus
//! something new: the first user message, a tool result or a later user message. A
//! turn of a tree-shaped session fans out into several concurrent [`Request`]s over the
//! same history (parallel tool calls, sub-agents); branch 0 is the main line the session
//! continues from, the others end with their response. Before each turn after the first
//! the client waits `think_s` after the previous turn's responses (a tool running, or a
//! user reading and typing).
//!
//! Invariants (tested by property): turn `t + 1`'s input, on every branch, starts with
//! turn `t`'s main-line input followed by its output; every request fits
//! `max_context`; the same seed and index give the same session. Sessions are drawn
//! independently by index ([`SessionGenerator::session`]), so a closed-loop driver or a
//! simulator can take as many as it needs, in any order.
use crate::dist::Dist;
use crate::error::WorkloadError;
use crate::params::{TokenRange, WorkloadParams};
use crate::tokens::{push_span_ids, SpanKey};
use kiln_core::rng::Rng;
use serde::{Deserialize, Serialize};

/// What the new input of a turn is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TurnKind {
    /// The session's opening user message.
    FirstMessage,
    /// Results of the tool calls the previous output made.
    ToolResult,
    /// A later user message.
    UserMessage,
}

/// One request: new tokens on top of the turn's history, and tokens to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Tokens added after the history.
    pub new_input: u32,
    /// Tokens to generate (`max_new_tokens`, with `ignore_eos`).
    pub output: u32,
}

/// One turn: the wait before it and its requests (one, or a concurrent fan-out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// What the new input is.
    pub kind: TurnKind,
    /// Seconds to wait after the previous turn's responses before sending (0 for the
    /// first turn).
    pub think_s: f64,
    /// The requests, sent concurrently; `requests[0]` is the main line.
    pub requests: Vec<Request>,
}

/// One session of an agent: turns over a growing shared history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Session {
    /// Index in the workload (the key of its token ids).
    pub index: u64,
    /// Whether some turns fan out into concurrent requests.
    pub tree: bool,
    /// Tokens of the shared system prompt every input starts with.
    pub system_prompt_tokens: u32,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// Workload seed (token ids derive from it).
    pub seed: u64,
    /// Token ids are drawn from this range.
    pub token_range: TokenRange,
}

impl Session {
    /// The value of the session header (`x-session-id`): unique per seed and index.
    pub fn id(&self) -> String {
        format!("s{:x}-{}", self.seed, self.index)
    }

    /// Tokens before turn `turn`'s new input: system prompt plus every earlier main-line
    /// new input and output.
    pub fn history_len(&self, turn: usize) -> u64 {
        let earlier: u64 = self.turns[..turn]
            .iter()
            .map(|t| (t.requests[0].new_input + t.requests[0].output) as u64)
            .sum();
        self.system_prompt_tokens as u64 + earlier
    }

    /// Prompt tokens of request `branch` of turn `turn`.
    pub fn input_len(&self, turn: usize, branch: usize) -> u64 {
        self.history_len(turn) + self.turns[turn].requests[branch].new_input as u64
    }

    /// Number of requests over all turns.
    pub fn request_count(&self) -> usize {
        self.turns.iter().map(|t| t.requests.len()).sum()
    }

    /// Ids of the shared system prompt (the same in every session of a seed).
    pub fn system_prompt_ids(&self) -> Vec<u32> {
        self.ids(SpanKey::SystemPrompt, self.system_prompt_tokens)
    }

    /// Ids of the new input of request `branch` of turn `turn`.
    pub fn new_input_ids(&self, turn: usize, branch: usize) -> Vec<u32> {
        let len = self.turns[turn].requests[branch].new_input;
        self.ids(self.key(turn, branch, false), len)
    }

    /// Ids the generator assumes request `branch` of turn `turn` outputs. A live driver
    /// appends the server's real output instead; a simulator uses these.
    pub fn output_ids(&self, turn: usize, branch: usize) -> Vec<u32> {
        let len = self.turns[turn].requests[branch].output;
        self.ids(self.key(turn, branch, true), len)
    }

    /// The full prompt of request `branch` of turn `turn`, with the generator's outputs
    /// standing in for earlier responses.
    pub fn input_ids(&self, turn: usize, branch: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.input_len(turn, branch) as usize);
        push_span_ids(
            &mut out,
            SpanKey::SystemPrompt,
            self.system_prompt_tokens,
            self.seed,
            self.token_range,
        );
        for (t, earlier) in self.turns[..turn].iter().enumerate() {
            let r = earlier.requests[0];
            self.push(&mut out, self.key(t, 0, false), r.new_input);
            self.push(&mut out, self.key(t, 0, true), r.output);
        }
        let new = self.turns[turn].requests[branch].new_input;
        self.push(&mut out, self.key(turn, branch, false), new);
        out
    }

    fn key(&self, turn: usize, branch: usize, output: bool) -> SpanKey {
        let (session, turn, branch) = (self.index, turn as u32, branch as u32);
        if output {
            SpanKey::Output {
                session,
                turn,
                branch,
            }
        } else {
            SpanKey::NewInput {
                session,
                turn,
                branch,
            }
        }
    }

    fn ids(&self, key: SpanKey, len: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(len as usize);
        self.push(&mut out, key, len);
        out
    }

    fn push(&self, out: &mut Vec<u32>, key: SpanKey, len: u32) {
        push_span_ids(out, key, len, self.seed, self.token_range);
    }
}

/// Draws sessions from [`WorkloadParams`] under a seed.
#[derive(Debug, Clone)]
pub struct SessionGenerator {
    params: WorkloadParams,
    seed: u64,
}

impl SessionGenerator {
    /// A generator for `params` (validated) under `seed`.
    pub fn new(params: WorkloadParams, seed: u64) -> Result<Self, WorkloadError> {
        params.validate()?;
        Ok(Self { params, seed })
    }

    /// The parameters sessions are drawn from.
    pub fn params(&self) -> &WorkloadParams {
        &self.params
    }

    /// The workload seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Session number `index`: a pure function of the seed, the parameters and `index`.
    pub fn session(&self, index: u64) -> Session {
        let p = &self.params;
        let mut rng = Rng::new(self.seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let tree = rng.uniform() < p.tree_session_share;
        let planned = p.turns.sample_count(&mut rng, 1);
        let mut session = Session {
            index,
            tree,
            system_prompt_tokens: p.system_prompt_tokens,
            turns: Vec::with_capacity(planned as usize),
            seed: self.seed,
            token_range: p.token_range,
        };
        let mut history = p.system_prompt_tokens as u64;
        for t in 0..planned {
            let mut turn = self.draw_turn(&mut rng, t, tree);
            if t == 0 {
                fit_first_turn(&mut turn.requests[0], history, p.max_context);
            }
            let longest = turn.requests.iter().map(|r| r.new_input + r.output).max();
            if history + longest.unwrap_or(0) as u64 > p.max_context as u64 {
                break;
            }
            history += (turn.requests[0].new_input + turn.requests[0].output) as u64;
            session.turns.push(turn);
        }
        session
    }

    /// Sessions `0..n`.
    pub fn sessions(&self, n: u64) -> Vec<Session> {
        (0..n).map(|i| self.session(i)).collect()
    }

    fn draw_turn(&self, rng: &mut Rng, t: u32, tree: bool) -> Turn {
        let p = &self.params;
        let (kind, think_s) = if t == 0 {
            (TurnKind::FirstMessage, 0.0)
        } else if rng.uniform() < p.user_turn_share {
            (TurnKind::UserMessage, p.user_think_s.sample(rng))
        } else {
            (TurnKind::ToolResult, p.tool_think_s.sample(rng))
        };
        let fanout = if tree && t > 0 && rng.uniform() < p.fork_probability {
            p.fanout_min + rng.below((p.fanout_max - p.fanout_min + 1) as usize) as u32
        } else {
            1
        };
        let new_input: &Dist = match kind {
            TurnKind::FirstMessage => &p.first_message,
            TurnKind::ToolResult => &p.tool_result,
            TurnKind::UserMessage => &p.user_message,
        };
        let requests = (0..fanout)
            .map(|_| Request {
                new_input: new_input.sample_count(rng, 1),
                output: p.output.sample_count(rng, 1),
            })
            .collect();
        Turn {
            kind,
            think_s,
            requests,
        }
    }
}

/// Shrinks the first request so that every session has at least one turn.
fn fit_first_turn(r: &mut Request, history: u64, max_context: u32) {
    let room = (max_context as u64).saturating_sub(history) as u32;
    r.output = r.output.min(room / 2).max(1);
    r.new_input = r.new_input.min(room - r.output).max(1);
}
