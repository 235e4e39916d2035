//! The parameters of a coding-agent workload, with full-scale defaults.
//!
//! The defaults describe the seed's traffic: sessions of dozens of turns behind a shared
//! ~16k-token system prompt with tool definitions; turn inputs averaging ~100k tokens and
//! outputs ~500 (about 200:1); tool-call gaps of tens of ms to seconds with a tail of
//! minutes, user gaps of seconds to minutes; a share of tree-shaped sessions that fan out
//! into concurrent requests over a common prefix (parallel tool calls, sub-agents).
//!
//! [`WorkloadParams::scaled`] shrinks every token count (and the context limit) by one
//! factor, so the same shape runs on a CPU against a tiny model; think times have their
//! own factor ([`WorkloadParams::think_scaled`]) since they are time, not context.
use crate::dist::Dist;
use crate::error::WorkloadError;
use serde::{Deserialize, Serialize};

/// Token ids a generated prompt draws from: `first..end`. Servers differ in vocabulary
/// size, and low ids are often special tokens (BOS, EOS, padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRange {
    /// Smallest id used.
    pub first: u32,
    /// One past the largest id used.
    pub end: u32,
}

impl Default for TokenRange {
    /// `3..259`: valid in every vocabulary kiln serves, the embedded tiny model included.
    fn default() -> Self {
        Self { first: 3, end: 259 }
    }
}

/// Everything that shapes a generated workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadParams {
    /// Tokens of the system prompt with tool definitions, shared by every session.
    pub system_prompt_tokens: u32,
    /// New tokens of a session's first user message (task, repository notes).
    pub first_message: Dist,
    /// New tokens a tool result adds (file reads, command output): heavy-tailed.
    pub tool_result: Dist,
    /// New tokens of a later user message.
    pub user_message: Dist,
    /// Output tokens per request (`max_new_tokens`, sent with `ignore_eos`).
    pub output: Dist,
    /// Turns per session before it ends (or reaches `max_context`).
    pub turns: Dist,
    /// Share of turns after the first that are user messages (the rest are tool results).
    pub user_turn_share: f64,
    /// Seconds between a response and the next request when a tool ran.
    pub tool_think_s: Dist,
    /// Seconds between a response and the next request when the user answers.
    pub user_think_s: Dist,
    /// Share of sessions that are tree-shaped (send concurrent requests).
    pub tree_session_share: f64,
    /// In a tree-shaped session, probability that a turn after the first fans out.
    pub fork_probability: f64,
    /// Concurrent requests of a fan-out: uniform in `fanout_min..=fanout_max` (at least 2).
    pub fanout_min: u32,
    /// See `fanout_min`.
    pub fanout_max: u32,
    /// A session ends before a turn whose input plus output would exceed this.
    pub max_context: u32,
    /// Token ids prompts draw from.
    pub token_range: TokenRange,
}

impl Default for WorkloadParams {
    fn default() -> Self {
        Self {
            system_prompt_tokens: 16_000,
            first_message: Dist::log_normal(2_000.0, 1.0, 50.0, 30_000.0),
            tool_result: Dist::log_normal(2_500.0, 1.3, 20.0, 40_000.0),
            user_message: Dist::log_normal(300.0, 1.0, 5.0, 8_000.0),
            output: Dist::log_normal(500.0, 1.0, 1.0, 8_000.0),
            turns: Dist::log_normal(60.0, 0.6, 2.0, 300.0),
            user_turn_share: 0.1,
            tool_think_s: Dist::log_normal(1.5, 1.5, 0.01, 300.0),
            user_think_s: Dist::log_normal(40.0, 1.0, 2.0, 900.0),
            tree_session_share: 0.15,
            fork_probability: 0.25,
            fanout_min: 2,
            fanout_max: 4,
            max_context: 256_000,
            token_range: TokenRange::default(),
        }
    }
}

impl WorkloadParams {
    /// Every token count multiplied by `scale` (system prompt, message and output sizes,
    /// context limit), each at least one token. `scale = 1` is the full-scale workload.
    pub fn scaled(&self, scale: f64) -> Self {
        Self {
            system_prompt_tokens: ((self.system_prompt_tokens as f64 * scale).round() as u32)
                .max(1),
            first_message: self.first_message.scaled_at_least(scale, 1.0),
            tool_result: self.tool_result.scaled_at_least(scale, 1.0),
            user_message: self.user_message.scaled_at_least(scale, 1.0),
            output: self.output.scaled_at_least(scale, 1.0),
            max_context: ((self.max_context as f64 * scale).round() as u32).max(2),
            ..self.clone()
        }
    }

    /// Think times multiplied by `factor` (0 removes them: back-to-back requests).
    pub fn think_scaled(&self, factor: f64) -> Self {
        let scale = |d: Dist| {
            if factor == 0.0 {
                Dist::constant(0.0)
            } else {
                d.scaled(factor)
            }
        };
        Self {
            tool_think_s: scale(self.tool_think_s),
            user_think_s: scale(self.user_think_s),
            ..self.clone()
        }
    }
}

impl WorkloadParams {
    /// Rejects parameters no workload can be drawn from: shares outside `[0, 1]`,
    /// distributions with a non-positive mean or `min > max`, a fan-out below 2, an empty token
    /// range, or a system prompt that leaves no room in `max_context`.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        let bad = |name, reason: String| Err(WorkloadError::InvalidParam { name, reason });
        for (name, share) in [
            ("user_turn_share", self.user_turn_share),
            ("tree_session_share", self.tree_session_share),
            ("fork_probability", self.fork_probability),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return bad(name, format!("{share} is not a probability"));
            }
        }
        for (name, d, positive) in [
            ("first_message", self.first_message, true),
            ("tool_result", self.tool_result, true),
            ("user_message", self.user_message, true),
            ("output", self.output, true),
            ("turns", self.turns, true),
            ("tool_think_s", self.tool_think_s, false),
            ("user_think_s", self.user_think_s, false),
        ] {
            let finite = [d.mean, d.sigma, d.min, d.max]
                .iter()
                .all(|x| x.is_finite());
            if !finite || d.sigma < 0.0 || d.min > d.max || d.min < 0.0 {
                return bad(name, format!("{d:?} is not a distribution"));
            }
            if positive && d.mean <= 0.0 {
                return bad(name, format!("mean {} must be positive", d.mean));
            }
        }
        if self.fanout_min < 2 || self.fanout_min > self.fanout_max {
            let (lo, hi) = (self.fanout_min, self.fanout_max);
            return bad(
                "fanout_min",
                format!("fan-out {lo}..={hi} has no size of 2 or more"),
            );
        }
        if self.token_range.first >= self.token_range.end {
            return bad("token_range", format!("{:?} is empty", self.token_range));
        }
        if self.system_prompt_tokens as u64 + 2 > self.max_context as u64 {
            let reason = format!(
                "{} leaves no room for a request under system_prompt_tokens {}",
                self.max_context, self.system_prompt_tokens
            );
            return bad("max_context", reason);
        }
        Ok(())
    }
}
