//! Mooncake trace replay: JSONL records turned into token ids that keep the traces'
//! prefix sharing.
//!
//! A Mooncake trace line is `{"timestamp": ms, "input_length": n, "output_length": m,
//! "hash_ids": [...]}` (Mooncake's FAST'25 release; SGLang's `bench_serving` replays the
//! same format): the prompt is cut into 512-token blocks and block `i` carries a hash id
//! that is equal across requests exactly when their first `i + 1` blocks are equal. Here
//! each hash id becomes one fixed random span ([`SpanKey::TraceBlock`]), so requests
//! that share hash ids share those token spans, and a prefix cache sees the same hits
//! the trace recorded. The last block is a prefix of its span when `input_length` is not
//! a multiple of 512; tokens past the hashed blocks (if any) come from a span unique to
//! the line.
//!
//! `scale` shrinks a block to `round(512 * scale)` tokens (at least 1) and every length
//! with it, so a trace runs against a small model with the same sharing structure.
use crate::error::WorkloadError;
use crate::params::TokenRange;
use crate::tokens::{push_span_ids, SpanKey};
use serde::{Deserialize, Serialize};

/// Tokens per hash block in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace, as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the trace's start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Tokens to generate.
    pub output_length: u32,
    /// Hash ids of the prompt's 512-token blocks, in order.
    pub hash_ids: Vec<u64>,
}

/// Parses Mooncake JSONL (blank lines skipped); errors name the 1-based line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, WorkloadError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| WorkloadError::BadTraceLine {
                line: i + 1,
                reason: e.to_string(),
            })
        })
        .collect()
}

/// Reads and parses a Mooncake JSONL file.
pub fn read_trace(path: &std::path::Path) -> Result<Vec<TraceRequest>, WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(|source| WorkloadError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_trace(&text)
}

/// Turns trace requests into token ids at a given scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceTokenizer {
    /// Tokens per hash block after scaling.
    pub block_tokens: u32,
    /// The scale lengths are multiplied by.
    pub scale: f64,
    /// Seed of the span ids.
    pub seed: u64,
    /// Token ids are drawn from this range.
    pub token_range: TokenRange,
}

impl TraceTokenizer {
    /// A tokenizer shrinking blocks and lengths by `scale` (1 keeps the trace's sizes).
    pub fn new(scale: f64, seed: u64, token_range: TokenRange) -> Self {
        let block_tokens = ((MOONCAKE_BLOCK_TOKENS as f64 * scale).round() as u32).max(1);
        Self {
            block_tokens,
            scale,
            seed,
            token_range,
        }
    }

    /// Prompt tokens of `r` after scaling: whole blocks become `block_tokens` each, the
    /// remainder shrinks in proportion (at least 1 token when there is one).
    pub fn input_len(&self, r: &TraceRequest) -> u32 {
        let full = r.input_length / MOONCAKE_BLOCK_TOKENS;
        let rem = r.input_length % MOONCAKE_BLOCK_TOKENS;
        let rem_scaled = (rem * self.block_tokens).div_ceil(MOONCAKE_BLOCK_TOKENS);
        full * self.block_tokens + rem_scaled
    }

    /// Tokens to generate for `r` after scaling (at least 1).
    pub fn output_len(&self, r: &TraceRequest) -> u32 {
        ((r.output_length as f64 * self.scale).round() as u32).max(1)
    }

    /// The prompt of `r` (line `line` of the trace): one span per hash id, cut at the
    /// scaled input length, then a span unique to the line for any tokens left.
    pub fn input_ids(&self, r: &TraceRequest, line: usize) -> Vec<u32> {
        let len = self.input_len(r);
        let mut out = Vec::with_capacity(len as usize);
        for &h in &r.hash_ids {
            let left = len - out.len() as u32;
            if left == 0 {
                break;
            }
            let take = left.min(self.block_tokens);
            push_span_ids(
                &mut out,
                SpanKey::TraceBlock(h),
                take,
                self.seed,
                self.token_range,
            );
        }
        let left = len - out.len() as u32;
        let tail = SpanKey::TraceTail(line as u64);
        push_span_ids(&mut out, tail, left, self.seed, self.token_range);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mooncake_line_parses() {
        let t = parse_trace(
            "{\"timestamp\": 27482, \"input_length\": 6955, \"output_length\": 52, \"hash_ids\": [46, 47, 48]}\n\n",
        )
        .unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(t[0].hash_ids, vec![46, 47, 48]);
        assert_eq!((t[0].timestamp, t[0].output_length), (27482, 52));
    }

    #[test]
    fn a_bad_line_is_reported_by_number() {
        let err = parse_trace("{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": []}\nnot json\n")
            .unwrap_err();
        assert!(err.to_string().starts_with("trace line 2:"), "{err}");
    }

    #[test]
    fn scaling_keeps_whole_blocks_whole() {
        let tok = TraceTokenizer::new(1.0 / 64.0, 0, TokenRange::default());
        assert_eq!(tok.block_tokens, 8);
        let r = TraceRequest {
            timestamp: 0,
            input_length: 2 * 512 + 100,
            output_length: 320,
            hash_ids: vec![1, 2, 3],
        };
        assert_eq!(tok.input_len(&r), 2 * 8 + 2);
        assert_eq!(tok.output_len(&r), 5);
        assert_eq!(tok.input_ids(&r, 0).len(), 18);
    }

    #[test]
    fn tokens_past_the_hashed_blocks_come_from_the_line() {
        let tok = TraceTokenizer::new(1.0 / 64.0, 0, TokenRange::default());
        let r = TraceRequest {
            timestamp: 0,
            input_length: 3 * 512,
            output_length: 1,
            hash_ids: vec![9],
        };
        let (a, b) = (tok.input_ids(&r, 1), tok.input_ids(&r, 2));
        assert_eq!(a.len(), 24);
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
    }
}
