//! Token ids for generated prompts, and text for servers that only take text.
//!
//! A prompt is a concatenation of spans (the system prompt, each turn's new input, each
//! turn's output). A span's ids are a pure function of the workload seed, the span's key
//! and the token range, so two prompts that contain the same span contain identical ids
//! there: prefix sharing in the workload is exact prefix sharing on the wire, which is
//! what a prefix cache (radix tree, block hashes) sees. Different spans are independent
//! random sequences, so they share no prefix beyond chance.
//!
//! For text-only servers, [`ids_to_text`] writes each id as one short common word; a
//! tokenizer maps a repeated word sequence to the same tokens, so prefix sharing
//! survives, while token counts are only approximate (the server's `usage` is what the
//! metrics use).
use crate::params::TokenRange;
use kiln_core::rng::Rng;
use serde::{Deserialize, Serialize};

/// What a span of tokens is; the key its ids derive from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SpanKey {
    /// The shared system prompt with tool definitions.
    SystemPrompt,
    /// New input of a request: session index, turn, branch.
    NewInput {
        /// Session index in the workload.
        session: u64,
        /// Turn index in the session.
        turn: u32,
        /// Branch within the turn (0 is the main line).
        branch: u32,
    },
    /// Output of a request (what the generator assumes the model wrote).
    Output {
        /// Session index in the workload.
        session: u64,
        /// Turn index in the session.
        turn: u32,
        /// Branch within the turn (0 is the main line).
        branch: u32,
    },
    /// One 512-token block of a replayed trace, by its hash id.
    TraceBlock(u64),
    /// Unhashed tail of a trace request, by line number.
    TraceTail(u64),
}

impl SpanKey {
    /// A 64-bit seed for this span under the workload seed (SplitMix64-style mixing of
    /// the key's fields, so nearby keys give unrelated streams).
    fn seed(&self, workload_seed: u64) -> u64 {
        let (tag, a, b, c) = match *self {
            SpanKey::SystemPrompt => (1, 0, 0, 0),
            SpanKey::NewInput {
                session,
                turn,
                branch,
            } => (2, session, turn as u64, branch as u64),
            SpanKey::Output {
                session,
                turn,
                branch,
            } => (3, session, turn as u64, branch as u64),
            SpanKey::TraceBlock(h) => (4, h, 0, 0),
            SpanKey::TraceTail(line) => (5, line, 0, 0),
        };
        [tag, a, b, c]
            .iter()
            .fold(workload_seed, |h, &x| mix(h ^ mix(x.wrapping_add(h))))
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Appends the `len` ids of span `key` to `out`.
pub fn push_span_ids(out: &mut Vec<u32>, key: SpanKey, len: u32, seed: u64, range: TokenRange) {
    let mut rng = Rng::new(key.seed(seed));
    let width = (range.end - range.first) as usize;
    out.extend((0..len).map(|_| range.first + rng.below(width) as u32));
}

/// The `len` ids of span `key`.
pub fn span_ids(key: SpanKey, len: u32, seed: u64, range: TokenRange) -> Vec<u32> {
    let mut out = Vec::with_capacity(len as usize);
    push_span_ids(&mut out, key, len, seed, range);
    out
}

/// Short, common English words: most tokenizers give each one (with its leading space)
/// a single token.
const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "it", "for", "on", "that", "with", "as", "at", "by",
    "this", "be", "or", "from", "an", "are", "not", "we", "if", "all", "can", "but", "one", "has",
    "was", "use", "new", "get", "set", "run", "file", "code", "line", "test", "data", "type",
    "name", "path", "list", "map", "key", "value", "error", "read", "write", "call", "self", "let",
    "fn", "mut", "int", "str", "true", "false", "none", "some", "ok", "end", "log", "id",
];

/// Text for a span of ids: one word per id, each with a leading space.
pub fn ids_to_text(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 5);
    for &id in ids {
        s.push(' ');
        s.push_str(WORDS[id as usize % WORDS.len()]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_span_gives_the_same_ids() {
        let r = TokenRange::default();
        let key = SpanKey::NewInput {
            session: 3,
            turn: 2,
            branch: 0,
        };
        assert_eq!(span_ids(key, 50, 9, r), span_ids(key, 50, 9, r));
    }

    #[test]
    fn a_shorter_span_is_a_prefix_of_a_longer_one() {
        let r = TokenRange::default();
        let long = span_ids(SpanKey::TraceBlock(17), 512, 1, r);
        assert_eq!(span_ids(SpanKey::TraceBlock(17), 100, 1, r), long[..100]);
    }

    #[test]
    fn different_spans_differ() {
        let r = TokenRange::default();
        let a = span_ids(SpanKey::TraceBlock(1), 64, 1, r);
        let b = span_ids(SpanKey::TraceBlock(2), 64, 1, r);
        let c = span_ids(SpanKey::TraceBlock(1), 64, 2, r);
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn ids_stay_in_the_token_range() {
        let r = TokenRange { first: 10, end: 13 };
        let ids = span_ids(SpanKey::SystemPrompt, 1000, 5, r);
        assert!(ids.iter().all(|&i| (10..13).contains(&i)));
        assert!((10..13).all(|v| ids.contains(&v)));
    }

    #[test]
    fn text_has_one_word_per_id() {
        assert_eq!(ids_to_text(&[0, 1, 64]), " the of the");
    }
}
