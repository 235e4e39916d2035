//! Trace replay keeps the sharing the hash ids encode: equal hash ids become identical
//! token spans, different ones different spans, at any scale.
use kiln_workload::trace::{parse_trace, TraceRequest, TraceTokenizer, MOONCAKE_BLOCK_TOKENS};
use kiln_workload::TokenRange;
use proptest::prelude::*;

/// Requests whose hash-id lists are prefixes of a few shared chains, plus a private
/// suffix, like agent turns over a common history.
fn arb_trace() -> impl Strategy<Value = Vec<TraceRequest>> {
    let chain = prop::collection::vec(0u64..40, 1..12);
    let request = (
        0usize..3,
        0usize..12,
        prop::collection::vec(1000u64..1100, 0..3),
        0u32..512,
        1u32..600,
    );
    (
        prop::collection::vec(chain, 3),
        prop::collection::vec(request, 2..12),
    )
        .prop_map(|(chains, requests)| {
            requests
                .into_iter()
                .enumerate()
                .map(|(i, (c, take, suffix, rem, out))| {
                    let chain = &chains[c];
                    let mut hash_ids: Vec<u64> = chain[..take.min(chain.len())].to_vec();
                    hash_ids.extend(suffix);
                    let full = hash_ids.len().saturating_sub(1) as u32;
                    TraceRequest {
                        timestamp: i as u64 * 100,
                        input_length: full * MOONCAKE_BLOCK_TOKENS + rem.max(1),
                        output_length: out,
                        hash_ids,
                    }
                })
                .filter(|r| !r.hash_ids.is_empty())
                .collect()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn blocks_that_share_hash_ids_become_identical_token_spans(
        trace in arb_trace(),
        scale in prop::sample::select(vec![1.0, 0.25, 1.0 / 64.0, 1.0 / 512.0]),
        seed: u64,
    ) {
        let tok = TraceTokenizer::new(scale, seed, TokenRange::default());
        let bt = tok.block_tokens as usize;
        let ids: Vec<Vec<u32>> = trace.iter().enumerate().map(|(i, r)| tok.input_ids(r, i)).collect();
        for (r, got) in trace.iter().zip(&ids) {
            prop_assert_eq!(got.len() as u32, tok.input_len(r));
        }
        for (a, ra) in trace.iter().enumerate() {
            for (b, rb) in trace.iter().enumerate() {
                // Whole blocks only: the last block of each request may be cut short.
                let full_a = ids[a].len() / bt;
                let full_b = ids[b].len() / bt;
                for i in 0..full_a.min(full_b).min(ra.hash_ids.len()).min(rb.hash_ids.len()) {
                    let (sa, sb) = (&ids[a][i * bt..(i + 1) * bt], &ids[b][i * bt..(i + 1) * bt]);
                    if ra.hash_ids[i] == rb.hash_ids[i] {
                        prop_assert_eq!(sa, sb, "block {} of lines {} and {}", i, a, b);
                    } else if bt >= 8 {
                        prop_assert_ne!(sa, sb, "block {} of lines {} and {}", i, a, b);
                    }
                }
            }
        }
    }
}

#[test]
fn a_trace_round_trips_through_jsonl() {
    let lines = "{\"timestamp\":0,\"input_length\":1024,\"output_length\":10,\"hash_ids\":[1,2]}\n\
                 {\"timestamp\":5,\"input_length\":1100,\"output_length\":20,\"hash_ids\":[1,2,3]}\n";
    let trace = parse_trace(lines).unwrap();
    let tok = TraceTokenizer::new(1.0, 7, TokenRange::default());
    let (a, b) = (tok.input_ids(&trace[0], 0), tok.input_ids(&trace[1], 1));
    assert_eq!((a.len(), b.len()), (1024, 1100));
    assert_eq!(a[..], b[..1024], "the second request extends the first");
}
