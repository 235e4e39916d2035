//! MLA prefill in the per-head form on every enabled backend (`kiln_conformance::mla::
//! run_mla_heads` against `kiln_reference::mla_heads`): the prefill cases' ragged batches,
//! page sizes and formats, head dims the tensor-core kernel takes and ones it does not, both
//! precisions, the context whole and in chunks.
use cubecl::prelude::*;
use kiln_conformance::mla::{run_mla_heads, AttnMode, MlaCase};
use kiln_kernels::mla::KvFormat;
use kiln_kernels::Precision;
use proptest::prelude::*;

use crate::cases::reports_pass;
use crate::mla::cases;

/// The per-head form over the same ragged batches, page sizes and formats as the prefill,
/// with head dims of Kimi's (nope 128, v 128), others the tensor-core kernel takes (32/48:
/// 6 k-steps, 3 pairs of value n-tiles) and odd smaller ones it does not (v past one unit
/// per value dimension, and short of it), at both precisions (on CUDA, bf16 or fp8 KV at
/// `Bf16` is the tensor-core kernel), the context whole or in chunks of 64 positions and
/// more (each chunk resuming from the state the one before left).
fn per_head_prefill<R: Runtime>(client: &ComputeClient<R>) {
    let dims = prop::sample::select(vec![(128usize, 128usize), (32, 48), (16, 72), (8, 5)]);
    let precisions = prop::sample::select(vec![Precision::Exact, Precision::Bf16]);
    let chunk_rows = prop::sample::select(vec![usize::MAX, 64, 200]);
    reports_pass(
        20,
        &(cases(AttnMode::Prefill, 150), dims, precisions, chunk_rows),
        |(case, (nope, v), precision, rows)| {
            run_mla_heads(client, case, *nope, *v, *precision, *rows)
        },
    );
}

/// Kimi's per-head shape over several query blocks (64 tokens) and 64-position tiles: a
/// prefill from nothing, an extend over a prefix that is not a multiple of the tile, and
/// a request shorter than a block beside them, both cache formats, whole and in chunks
/// (of 192 positions: chunk ends inside query blocks' spans).
fn per_head_prefill_blocks<R: Runtime>(client: &ComputeClient<R>) {
    for (q_lens, kv_lens, format, chunk_rows) in [
        (
            vec![300, 70, 1],
            vec![300, 1000, 5],
            KvFormat::Bf16,
            usize::MAX,
        ),
        (vec![129, 64], vec![333, 64], KvFormat::Fp8, usize::MAX),
        (
            vec![300, 70, 1],
            vec![300, 1000, 5],
            KvFormat::Bf16,
            3 * 192,
        ),
    ] {
        let case = MlaCase {
            heads: 4,
            page_size: 64,
            q_lens,
            kv_lens,
            format,
            mode: AttnMode::Prefill,
            seed: 13,
            huge_tile: false,
            tree: false,
        };
        run_mla_heads(client, &case, 128, 128, Precision::Bf16, chunk_rows)
            .unwrap()
            .assert_passed();
    }
}

kiln_backends::backend_tests! {
    per_head_prefill,
    per_head_prefill_blocks,
}
