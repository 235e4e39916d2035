//! Drafts for speculative decoding: a drafter proposes a tree of tokens likely to follow a
//! request's tokens ([`Draft`]); the scheduler runs them through the model in the
//! request's next step (its last token plus the tree's nodes, each seeing its ancestors)
//! and keeps the path that verification accepts from the root plus one token of the
//! model's own (`sampling::verify`), so the output is exactly what decoding one token a
//! step would give, greedy or sampled.
//!
//! - [`NgramDrafter`] (prompt lookup): the most recent earlier occurrence of the longest
//!   suffix of the request's tokens (up to [`NGRAM_MAX`] long) and what followed it. Naive,
//!   linear in the request's length per proposal: the oracle of the drafters below, and
//!   already right for agent traffic, whose outputs quote their inputs.
//! - [`IndexedNgramDrafter`]: the same proposals from an index of every request's n-grams
//!   (their latest end), extended by the tokens appended since its last proposal (never
//!   rebuilt) and dropped when the request ends: constant work per token instead of a scan
//!   of a 100k-token history per step. What `--speculative ngram` runs.
//! - [`SuffixDrafter`]: frequency-scored continuations of the longest matching context, in
//!   the request's own tokens and in all requests' recent outputs ([`suffix`]). What
//!   `--speculative suffix` runs.
//! - [`SimulatedDrafter`] with [`SpecConfig::simulated_accept_len`]: a benchmark mode, as
//!   SGLang's `SGLANG_SIMULATE_ACC_LEN`: every decoding request drafts what the draft
//!   policy gives it (the most it may under [`DraftPolicy::Fixed`]) and verification keeps
//!   as many drafted tokens as give the set mean accept length, or all of a shorter draft
//!   ([`simulated_accepts`]), so the cost of speculation at a given acceptance is measured
//!   on any model (a synthetic one's outputs match no drafter). Outputs are not the model's.
//! - [`draft_len`]: how many tokens a request may draft in a step (its limits), and
//!   [`policy`]: how many it does, from measured verification cost and acceptance.

mod draft;
mod handoff;
pub mod policy;
mod suffix;

use std::collections::HashMap;

pub use draft::{Draft, MAX_DRAFT_NODES, ROOT};
pub use handoff::RETAINED_INDEXES;
use handoff::{Handoff, Indexed};
pub use policy::DraftPolicy;
pub use suffix::SuffixDrafter;

/// Longest suffix the n-gram drafter matches.
pub const NGRAM_MAX: usize = 4;
/// Shortest suffix it matches (a single token matches too often to be worth a draft).
pub const NGRAM_MIN: usize = 2;
/// Above this many requests decoding at once, a step is no longer bound by reading the
/// weights, so verifying drafts costs about what it gains: speculation is off.
pub const MAX_SPECULATIVE_BATCH: usize = 16;

/// Proposes drafts from a request's tokens; learns from what was accepted.
pub trait Drafter: Send {
    /// A tree of up to `max` tokens likely to follow `tokens` (request `id`'s prompt and
    /// output).
    fn propose(&mut self, id: u64, tokens: &[u32], max: usize) -> Draft;
    /// Verification kept `accepted` of the `drafted` tokens of request `id`'s last draft.
    fn accepted(&mut self, _id: u64, _drafted: usize, _accepted: usize) {}
    /// Request `id` ended: forget it.
    fn finished(&mut self, _id: u64) {}
    /// Host memory the drafter holds, about (reported in `/metrics`).
    fn memory_bytes(&self) -> usize {
        0
    }
}

/// Prompt lookup: see the module docs.
#[derive(Debug, Default)]
pub struct NgramDrafter;

impl Drafter for NgramDrafter {
    fn propose(&mut self, _id: u64, tokens: &[u32], max: usize) -> Draft {
        let len = tokens.len();
        for n in (NGRAM_MIN..=NGRAM_MAX.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // The most recent earlier occurrence that has a continuation.
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let from = start + n;
                return Draft::chain(tokens[from..(from + max).min(len)].to_vec());
            }
        }
        Draft::default()
    }
}

/// An n-gram of up to [`NGRAM_MAX`] tokens: its length and its tokens (zero-padded).
type Gram = (u8, [u32; NGRAM_MAX]);

fn gram(tokens: &[u32]) -> Gram {
    let mut key = [0; NGRAM_MAX];
    key[..tokens.len()].copy_from_slice(tokens);
    (tokens.len() as u8, key)
}

/// One request's index: the latest end of each n-gram among its first `indexed` ends.
type GramIndex = Indexed<HashMap<Gram, usize>>;

fn gram_index_bytes(index: &GramIndex) -> usize {
    index.data.capacity() * std::mem::size_of::<(Gram, usize)>()
}

/// Prompt lookup from an incremental index: see the module docs. An ended request's index
/// passes to the next request that extends its tokens ([`handoff`]).
#[derive(Debug, Default)]
pub struct IndexedNgramDrafter {
    requests: HashMap<u64, GramIndex>,
    retained: Handoff<HashMap<Gram, usize>>,
}

impl Drafter for IndexedNgramDrafter {
    fn propose(&mut self, id: u64, tokens: &[u32], max: usize) -> Draft {
        let len = tokens.len();
        let retained = &mut self.retained;
        let index = self
            .requests
            .entry(id)
            .or_insert_with(|| retained.take(tokens).unwrap_or_default());
        if index.indexed > len {
            *index = GramIndex::default(); // not this request's tokens: start over
        }
        // Every end before the current one: an occurrence with a continuation.
        for end in index.indexed + 1..len {
            for n in NGRAM_MIN..=NGRAM_MAX.min(end) {
                index.data.insert(gram(&tokens[end - n..end]), end);
            }
        }
        let to = index.indexed.max(len.saturating_sub(1));
        index.advance_to(tokens, to);
        for n in (NGRAM_MIN..=NGRAM_MAX.min(len.saturating_sub(1))).rev() {
            if let Some(&end) = index.data.get(&gram(&tokens[len - n..])) {
                return Draft::chain(tokens[end..(end + max).min(len)].to_vec());
            }
        }
        Draft::default()
    }

    fn finished(&mut self, id: u64) {
        if let Some(index) = self.requests.remove(&id) {
            let bytes = gram_index_bytes(&index);
            self.retained.keep(index, bytes);
        }
    }

    fn memory_bytes(&self) -> usize {
        let indexes = self.requests.values().chain(self.retained.iter());
        indexes.map(gram_index_bytes).sum()
    }
}

/// Drafts of the most tokens allowed (the request's last token repeated), for the
/// simulated-acceptance benchmark mode: see the module docs.
#[derive(Debug, Default)]
pub struct SimulatedDrafter;

impl Drafter for SimulatedDrafter {
    fn propose(&mut self, _id: u64, tokens: &[u32], max: usize) -> Draft {
        Draft::chain(tokens.last().map_or(Vec::new(), |&t| vec![t; max]))
    }
}

/// Which drafter serves a request's drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// Prompt lookup ([`IndexedNgramDrafter`]).
    Ngram,
    /// Frequency-scored continuations of the longest matching context ([`SuffixDrafter`]).
    Suffix,
    /// Full-length drafts for simulated acceptance ([`SimulatedDrafter`]).
    Simulated,
}

impl DrafterKind {
    pub fn build(self) -> Box<dyn Drafter> {
        match self {
            DrafterKind::Ngram => Box::new(IndexedNgramDrafter::default()),
            DrafterKind::Suffix => Box::new(SuffixDrafter::default()),
            DrafterKind::Simulated => Box::new(SimulatedDrafter),
        }
    }
}

/// Speculative decoding's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    pub drafter: DrafterKind,
    /// Most tokens one request drafts per step.
    pub max_draft: usize,
    /// How many it drafts within that.
    pub policy: DraftPolicy,
    /// Benchmark mode: verification keeps drafted tokens at random so that a verify step
    /// emits this many tokens on average ([`simulated_accepts`]) instead of checking them
    /// against the model. Not lossless: for measuring speed only.
    pub simulated_accept_len: Option<f64>,
}

/// Drafted tokens a verify step keeps in simulated-acceptance mode: `accept_len - 1` on
/// average (the bonus token makes up the rest), `floor` or `floor + 1` of them drawn with
/// `uniform` in `[0, 1)`, never more than the `drafted`.
pub fn simulated_accepts(accept_len: f64, drafted: usize, uniform: f64) -> usize {
    let mean = (accept_len - 1.0).max(0.0);
    let whole = mean.floor();
    let extra = usize::from(uniform < mean - whole);
    (whole as usize + extra).min(drafted)
}

/// Tokens a decoding request may draft this step: none when `decoding` requests share the
/// step past [`MAX_SPECULATIVE_BATCH`]; else up to `max_draft` (and [`MAX_DRAFT_NODES`]),
/// within the step's token `budget` left after this request's own token and within its
/// event channel's `room` (a token per accepted draft, the bonus token and the end).
pub fn draft_len(max_draft: usize, decoding: usize, budget: usize, room: usize) -> usize {
    if decoding > MAX_SPECULATIVE_BATCH {
        return 0;
    }
    max_draft
        .min(MAX_DRAFT_NODES)
        .min(budget.saturating_sub(1))
        .min(room.saturating_sub(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The index proposes what the naive scan does, as a request grows by appends of
        /// any length, for any draft size, over alphabets small enough to repeat.
        #[test]
        fn the_index_proposes_what_the_scan_finds(
            alphabet in 2u32..6,
            seed_tokens in prop::collection::vec(0u32..1000, 1..40),
            appends in prop::collection::vec((1usize..6, 1usize..7), 1..30),
            appends_again in prop::collection::vec((1usize..6, 1usize..7), 1..10),
        ) {
            let mut tokens: Vec<u32> = seed_tokens.iter().map(|t| t % alphabet).collect();
            let (mut naive, mut indexed) = (NgramDrafter, IndexedNgramDrafter::default());
            let mut next = 7u32;
            for &(grow, max) in &appends {
                for _ in 0..grow {
                    next = next.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    tokens.push((next >> 16) % alphabet);
                }
                prop_assert_eq!(indexed.propose(3, &tokens, max), naive.propose(3, &tokens, max));
            }
            indexed.finished(3);
            prop_assert!(indexed.requests.is_empty());
            // The next request extends the first's tokens (it takes the index over), or
            // changes one of them (it must not): the same proposals either way.
            let mut next_tokens = tokens.clone();
            if let Some(&(grow, _)) = appends.first() {
                if grow % 2 == 0 {
                    let at = next % next_tokens.len() as u32;
                    next_tokens[at as usize] = (next_tokens[at as usize] + 1) % alphabet;
                }
            }
            for (grow, max) in appends_again {
                for _ in 0..grow {
                    next = next.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    next_tokens.push((next >> 16) % alphabet);
                }
                prop_assert_eq!(
                    indexed.propose(4, &next_tokens, max),
                    naive.propose(4, &next_tokens, max)
                );
            }
        }
    }

    #[test]
    fn a_next_turn_takes_over_the_index_of_the_turn_it_extends() {
        let turn: Vec<u32> = (0..1000).map(|i| (i * 7 % 13) as u32).collect();
        let mut d = IndexedNgramDrafter::default();
        d.propose(1, &turn, 4);
        d.finished(1);
        assert_eq!(d.retained.iter().count(), 1);
        // Another history: not taken.
        let mut other = turn.clone();
        other[10] = 99;
        d.propose(2, &other, 4);
        assert_eq!(d.retained.iter().count(), 1);
        // The next turn: the whole history and more.
        let mut next = turn.clone();
        next.extend([5, 6, 7]);
        assert_eq!(d.propose(3, &next, 4), NgramDrafter.propose(3, &next, 4));
        assert_eq!(d.retained.iter().count(), 0, "taken over");
        for id in 10..10 + RETAINED_INDEXES as u64 + 3 {
            let mut own = turn.clone();
            own[0] = 100 + id as u32; // histories of their own: none taken over
            d.propose(id, &own, 4);
            d.finished(id);
        }
        assert_eq!(d.retained.iter().count(), RETAINED_INDEXES, "bounded");
        assert!(d.memory_bytes() > RETAINED_INDEXES * 1000, "and reported");
    }

    #[test]
    fn ngram_drafts_continue_the_latest_longest_match() {
        let mut d = NgramDrafter;
        // "7 8 9" occurred twice; the latest is followed by 4 5.
        let tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9];
        assert_eq!(d.propose(0, &tokens, 2).tokens, vec![4, 5]);
        assert_eq!(d.propose(0, &tokens, 10).tokens, vec![4, 5, 6, 0, 7, 8, 9]);
        assert!(
            d.propose(0, &[1, 2, 3, 4], 4).is_empty(),
            "no repeat, no draft"
        );
        assert!(d.propose(0, &[5], 4).is_empty());
        // A suffix of two matches when three do not.
        assert_eq!(
            d.propose(0, &[1, 2, 9, 9, 3, 1, 2], 3),
            Draft::chain(vec![9, 9, 3])
        );
    }

    #[test]
    fn simulated_acceptance_averages_the_set_length() {
        let uniform = |i: usize| (i as f64 + 0.5) / 1000.0;
        for (len, drafted) in [(1.0, 5), (2.5, 5), (4.0, 3), (3.25, 8), (6.0, 5)] {
            let kept: usize = (0..1000)
                .map(|i| simulated_accepts(len, drafted, uniform(i)))
                .sum();
            assert!((kept as f64 / 1000.0 + 1.0 - len).abs() < 1e-9, "{len}");
        }
        assert_eq!(simulated_accepts(9.0, 5, 0.5), 5, "at most the draft");
        assert_eq!(simulated_accepts(0.5, 5, 0.0), 0);
        assert_eq!(
            SimulatedDrafter.propose(0, &[4, 9], 3).tokens,
            vec![9, 9, 9]
        );
    }

    #[test]
    fn drafts_fit_the_batch_the_budget_and_the_channel() {
        assert_eq!(draft_len(4, 1, 100, 64), 4);
        assert_eq!(draft_len(4, MAX_SPECULATIVE_BATCH + 1, 100, 64), 0);
        assert_eq!(draft_len(4, 1, 3, 64), 2);
        assert_eq!(draft_len(4, 1, 100, 4), 2);
        assert_eq!(draft_len(4, 1, 1, 64), 0);
        assert_eq!(draft_len(100, 1, 1000, 1000), MAX_DRAFT_NODES);
    }
}
