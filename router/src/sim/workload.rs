//! The simulator's session model: closed-loop agent sessions drawn by index.
//!
//! A [`SimSession`] is the part of a benchmark session the simulator needs: the shared
//! system prompt's size and, per turn, the think time before it and its concurrent
//! requests (new input and output tokens). It mirrors `kiln_workload::Session` field for
//! field, so a [`SessionSource`] over the benchmark's seeded generator is a direct
//! mapping; until that crate is in the tree's history, [`BuiltinSessions`] draws the
//! same shape (the benchmark's default distributions: log-normal sizes and gaps by mean
//! and shape, clamped) from its own seed.

use kiln_reference::data::Rng;

/// One request of a turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimRequest {
    /// Tokens added after the turn's history.
    pub new_input: u32,
    /// Tokens generated.
    pub output: u32,
}

/// One turn: a wait, then requests sent together (`requests[0]` is the main line).
#[derive(Debug, Clone, PartialEq)]
pub struct SimTurn {
    /// Seconds after the previous turn's responses before this turn is sent.
    pub think_s: f64,
    /// The concurrent requests.
    pub requests: Vec<SimRequest>,
}

/// A session: a growing history over a shared system prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct SimSession {
    /// Tokens of the system prompt every session shares (cached on every replica).
    pub system_prompt_tokens: u32,
    /// The turns in order.
    pub turns: Vec<SimTurn>,
}

impl SimSession {
    /// Tokens before turn `turn`'s new input (system prompt, earlier main-line turns).
    pub fn history_len(&self, turn: usize) -> u64 {
        let earlier: u64 = self.turns[..turn]
            .iter()
            .map(|t| u64::from(t.requests[0].new_input) + u64::from(t.requests[0].output))
            .sum();
        u64::from(self.system_prompt_tokens) + earlier
    }
}

/// Where sessions come from: a pure function of the index.
pub trait SessionSource {
    /// Session number `index`.
    fn session(&self, index: u64) -> SimSession;
}

/// A log-normal given by its mean and the standard deviation of its log, clamped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormal {
    /// Mean before clamping.
    pub mean: f64,
    /// Standard deviation of the log.
    pub sigma: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl LogNormal {
    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        let mu = self.mean.ln() - self.sigma * self.sigma / 2.0;
        (mu + self.sigma * rng.normal())
            .exp()
            .clamp(self.min, self.max)
    }

    fn count(&self, rng: &mut Rng) -> u32 {
        (self.sample(rng).round() as u32).max(1)
    }
}

/// The benchmark's default coding-agent sessions (see the module docs), with its
/// tree-shaped share and a configurable fan-out.
#[derive(Debug, Clone, PartialEq)]
pub struct BuiltinSessions {
    /// Workload seed.
    pub seed: u64,
    /// Shared system prompt tokens.
    pub system_prompt_tokens: u32,
    /// First user message tokens.
    pub first_message: LogNormal,
    /// Tool result tokens.
    pub tool_result: LogNormal,
    /// Later user message tokens.
    pub user_message: LogNormal,
    /// Output tokens per request.
    pub output: LogNormal,
    /// Turns per session.
    pub turns: LogNormal,
    /// Share of turns that are user messages.
    pub user_turn_share: f64,
    /// Think seconds after a tool call.
    pub tool_think_s: LogNormal,
    /// Think seconds before a user message.
    pub user_think_s: LogNormal,
    /// Share of tree-shaped sessions.
    pub tree_session_share: f64,
    /// Probability that a tree-shaped session's turn fans out.
    pub fork_probability: f64,
    /// Fan-out range of such a turn.
    pub fanout: (u32, u32),
    /// A session ends before exceeding this context.
    pub max_context: u64,
}

impl BuiltinSessions {
    /// The benchmark's defaults under `seed`, with fan-outs of `fanout.0..=fanout.1`.
    pub fn new(seed: u64, fanout: (u32, u32)) -> Self {
        let ln = |mean, sigma, min, max| LogNormal {
            mean,
            sigma,
            min,
            max,
        };
        Self {
            seed,
            system_prompt_tokens: 16_000,
            first_message: ln(2_000.0, 1.0, 50.0, 30_000.0),
            tool_result: ln(2_500.0, 1.3, 20.0, 40_000.0),
            user_message: ln(300.0, 1.0, 5.0, 8_000.0),
            output: ln(500.0, 1.0, 1.0, 8_000.0),
            turns: ln(60.0, 0.6, 2.0, 300.0),
            user_turn_share: 0.1,
            tool_think_s: ln(1.5, 1.5, 0.01, 300.0),
            user_think_s: ln(40.0, 1.0, 2.0, 900.0),
            tree_session_share: 0.15,
            fork_probability: 0.25,
            fanout,
            max_context: 256_000,
        }
    }
}

impl SessionSource for BuiltinSessions {
    fn session(&self, index: u64) -> SimSession {
        let mut rng = Rng::new(self.seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let tree = rng.uniform() < self.tree_session_share;
        let planned = self.turns.count(&mut rng);
        let mut history = u64::from(self.system_prompt_tokens);
        let mut turns = Vec::new();
        for t in 0..planned {
            let (think_s, size) = if t == 0 {
                (0.0, self.first_message)
            } else if rng.uniform() < self.user_turn_share {
                (self.user_think_s.sample(&mut rng), self.user_message)
            } else {
                (self.tool_think_s.sample(&mut rng), self.tool_result)
            };
            let fans = tree && t > 0 && rng.uniform() < self.fork_probability;
            let (lo, hi) = self.fanout;
            let width = if fans {
                lo + rng.below((hi - lo + 1) as usize) as u32
            } else {
                1
            };
            let requests: Vec<SimRequest> = (0..width)
                .map(|_| SimRequest {
                    new_input: size.count(&mut rng),
                    output: self.output.count(&mut rng),
                })
                .collect();
            let longest = requests
                .iter()
                .map(|r| u64::from(r.new_input + r.output))
                .max()
                .unwrap_or(0);
            if history + longest > self.max_context {
                break;
            }
            history += u64::from(requests[0].new_input + requests[0].output);
            turns.push(SimTurn { think_s, requests });
        }
        SimSession {
            system_prompt_tokens: self.system_prompt_tokens,
            turns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_index_gives_the_same_session() {
        let source = BuiltinSessions::new(7, (2, 4));
        assert_eq!(source.session(3), source.session(3));
        assert_ne!(source.session(3), source.session(4));
    }

    #[test]
    fn sessions_have_dozens_of_turns_and_fit_the_context() {
        let source = BuiltinSessions::new(1, (2, 4));
        let sessions: Vec<SimSession> = (0..200).map(|i| source.session(i)).collect();
        let turns: usize = sessions.iter().map(|s| s.turns.len()).sum();
        assert!(
            (30..90).contains(&(turns / sessions.len())),
            "{}",
            turns / sessions.len()
        );
        for s in &sessions {
            assert!(!s.turns.is_empty());
            assert!(s.history_len(s.turns.len()) <= source.max_context);
        }
    }

    #[test]
    fn only_tree_shaped_sessions_fan_out_within_the_range() {
        let source = BuiltinSessions::new(5, (2, 8));
        let widths: Vec<usize> = (0..300)
            .flat_map(|i| {
                source
                    .session(i)
                    .turns
                    .into_iter()
                    .map(|t| t.requests.len())
            })
            .collect();
        assert!(widths.iter().all(|&w| (1..=8).contains(&w)));
        let fanned = widths.iter().filter(|&&w| w > 1).count() as f64 / widths.len() as f64;
        // 15% tree-shaped sessions x 25% of their turns.
        assert!((0.02..0.06).contains(&fanned), "{fanned}");
    }
}
