//! MLA attention conformance on every enabled backend: proptest over heads (odd), page
//! sizes (1, odd, the kernel's chunk), ragged batches (q_len from 1 to the whole context,
//! kv_len not a multiple of the page or chunk), both KV formats and both tilings.
use cubecl::prelude::*;
use kiln_conformance::mla::{run_mla, AttnMode, MlaCase};
use kiln_kernels::mla::{mla_decode, mla_prefill, AttnMetadata, KvFormat, PagedKvCache};
use kiln_kernels::{DeviceArray, KernelError};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn formats() -> impl Strategy<Value = KvFormat> {
    prop_oneof![Just(KvFormat::Bf16), Just(KvFormat::Fp8)]
}

/// Requests as (q_len, kv_len) with q_len <= max_q (and <= kv_len).
fn requests(max_q: usize, max_kv: usize) -> impl Strategy<Value = Vec<(usize, usize)>> {
    prop::collection::vec(
        (1usize..=max_kv).prop_flat_map(move |kv| (1usize..=kv.min(max_q), Just(kv))),
        1..=3,
    )
}

fn cases(mode: AttnMode, max_q: usize) -> impl Strategy<Value = MlaCase> {
    (
        1usize..=3,
        prop::sample::select(vec![1usize, 7, 16, 64]),
        requests(max_q, 150),
        formats(),
        any::<u64>(),
    )
        .prop_map(move |(heads, page_size, reqs, format, seed)| MlaCase {
            heads,
            page_size,
            q_lens: reqs.iter().map(|r| r.0).collect(),
            kv_lens: reqs.iter().map(|r| r.1).collect(),
            format,
            mode,
            seed,
        })
}

fn run_cases<R: Runtime>(client: &ComputeClient<R>, strategy: impl Strategy<Value = MlaCase>) {
    let mut runner = TestRunner::new(Config {
        cases: 16,
        ..Config::default()
    });
    runner
        .run(&strategy, |case| {
            let report = run_mla(client, &case, false).expect("valid case launches");
            prop_assert!(report.passed, "{case:?}: {}", report.detail);
            Ok(())
        })
        .unwrap();
}

fn decode<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(client, cases(AttnMode::Decode, 5));
}

fn prefill<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(client, cases(AttnMode::Prefill, 150));
}

/// Kimi's 64 heads over a few chunks, and a draft-verification step of 16 query tokens.
fn kimi_shapes<R: Runtime>(client: &ComputeClient<R>) {
    for (heads, q_lens, kv_lens, format) in [
        (64, vec![1, 1], vec![200, 129], KvFormat::Bf16),
        (64, vec![1], vec![333], KvFormat::Fp8),
        (4, vec![16, 3], vec![260, 3], KvFormat::Bf16),
    ] {
        let case = MlaCase {
            heads,
            page_size: 64,
            q_lens,
            kv_lens,
            format,
            mode: AttnMode::Decode,
            seed: 11,
        };
        run_mla(client, &case, false).unwrap().assert_passed();
    }
}

fn bad_metadata_is_a_typed_error<R: Runtime>(client: &ComputeClient<R>) {
    let heads = 2;
    let meta = |max_q_len: usize| AttnMetadata {
        batch: 1,
        num_tokens: max_q_len,
        max_q_len,
        cu_q_lens: DeviceArray::upload(client, &[0u32, max_q_len as u32]),
        kv_lens: DeviceArray::upload(client, &[max_q_len as u32]),
        block_table: DeviceArray::upload(client, &[0u32, 1]),
        max_blocks: 2,
    };
    let cache = PagedKvCache {
        data: DeviceArray::upload(client, &vec![0x3f80_3f80u32; 2 * 64 * 288]),
        format: KvFormat::Bf16,
        page_size: 64,
        num_pages: 2,
    };
    let q = DeviceArray::upload(client, &vec![0.5f32; 65 * heads * 576]);
    let out = DeviceArray::filled(client, 65 * heads * 512, f32::NAN);
    // Decode takes at most 64 query tokens per request.
    assert!(matches!(
        mla_decode(client, &q, heads, &cache, &meta(65), 0.1, &out),
        Err(KernelError::Range {
            what: "query tokens per request (decode)",
            ..
        })
    ));
    // Query buffer disagrees with num_tokens * heads * 576.
    assert_eq!(
        mla_prefill(client, &q, heads, &cache, &meta(3), 0.1, &out),
        Err(KernelError::Length {
            what: "queries",
            expected: 3 * heads * 576,
            got: 65 * heads * 576
        })
    );
    // A cache whose buffer does not hold num_pages * page_size rows.
    let short = PagedKvCache {
        num_pages: 3,
        ..cache
    };
    assert!(matches!(
        mla_prefill(client, &q, heads, &short, &meta(65), 0.1, &out),
        Err(KernelError::Length {
            what: "KV cache (u32 words)",
            ..
        })
    ));
}

kiln_backends::backend_tests! {
    decode,
    prefill,
    kimi_shapes,
    bad_metadata_is_a_typed_error,
}
