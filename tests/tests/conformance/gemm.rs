//! NVFP4 GEMM conformance on every enabled backend: proptest over shapes (M = 1, odd N,
//! K any multiple of the 16-element scale block, empty experts) and values (normal with
//! outliers), activations in f32 and, where the device stores it, bf16. Dense cases with
//! M <= 16 and K a multiple of 32 (NVFP4) or 8 (bf16) take the decode (skinny) kernel, the
//! rest the per-element kernel; on CUDA the skinny kernel decodes E2M1 through f32
//! subnormals and reduces with plane sums, on wgpu (llvmpipe) it takes the portable decode
//! and the shared-memory reduction. On CUDA, NVFP4 weights whose shape tiles (N % 16, K % 64)
//! are re-laid out into MMA fragments at upload and decode GEMMs over them (and over bf16
//! with K % 64) take the tensor-core GEMV.
use crate::cases::reports_pass;
use cubecl::prelude::*;
use half::bf16;
use kiln_conformance::gemm::{run_gemm, upload_weights, GemmCase};
use kiln_conformance::Activation;
use kiln_kernels::gemm::fragments::{from_fragments_host, to_fragments, to_fragments_host};
use kiln_kernels::gemm::{
    bf16_gemm, gated_gemm, nvfp4_gemm, nvfp4_grouped_gemm, nvfp4_layout, Bf16Weights, GemmPath,
    Nvfp4Layout, Nvfp4Weights, Operand, WeightFormat, GEMV_MAX_M_NVFP4,
};
use kiln_kernels::{DeviceArray, KernelError, Precision};
use kiln_reference::data::Rng;
use kiln_reference::nvfp4::Nvfp4Matrix;
use proptest::prelude::*;

fn dense_cases() -> impl Strategy<Value = GemmCase> {
    (1usize..=9, 1usize..=70, 1usize..=12, any::<u64>())
        .prop_map(|(m, n, blocks, seed)| GemmCase::dense(m, n, blocks * 16, seed))
}

fn grouped_cases() -> impl Strategy<Value = GemmCase> {
    (
        prop::collection::vec(0usize..=4, 1..=6),
        1usize..=40,
        1usize..=6,
        any::<u64>(),
    )
        .prop_filter("at least one row", |(rows, ..)| {
            rows.iter().sum::<usize>() > 0
        })
        .prop_map(|(rows, n, blocks, seed)| GemmCase::grouped(rows, n, blocks * 16, seed))
}

fn gemm_cases<R: Runtime, F: Activation>(
    client: &ComputeClient<R>,
    strategy: impl Strategy<Value = GemmCase>,
) {
    reports_pass(24, &strategy, |case| run_gemm::<R, F>(client, case, false));
}

fn dense<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    gemm_cases::<R, F>(client, dense_cases());
}

fn grouped<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    gemm_cases::<R, F>(client, grouped_cases());
}

/// bf16 weights, dense and grouped: K only needs to be even, so odd multiples of 2 are
/// covered.
fn bf16_weights<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    let dense = (1usize..=9, 1usize..=70, 1usize..=100, any::<u64>())
        .prop_map(|(m, n, half_k, seed)| GemmCase::bf16(m, n, 2 * half_k, seed));
    gemm_cases::<R, F>(client, dense);
    let grouped = grouped_cases().prop_map(|c| GemmCase {
        format: WeightFormat::Bf16,
        ..c
    });
    gemm_cases::<R, F>(client, grouped);
}

/// Shapes for the tiled kernel (CUDA tensor cores; the portable kernel elsewhere): M past
/// the decode kernels' limits with partial 64-row tiles (NVFP4 in the fragment layout where
/// N % 16 == 0), N with a partial 128-column tile, K of one and
/// of three 64-steps, K split over cubes (few tiles, 16+ steps), and experts with several
/// tiles, a partial one and none.
fn tiled_shapes_match_the_reference<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    for (i, (m, n, k)) in [
        (17, 21, 64),
        (80, 128, 192),
        (65, 200, 64),
        (130, 37, 128),
        (70, 96, 1088),
    ]
    .into_iter()
    .enumerate()
    {
        for case in [
            GemmCase::dense(m, n, k, 400 + i as u64),
            GemmCase::bf16(m, n, k, 410 + i as u64),
        ] {
            run_gemm::<R, F>(client, &case, false)
                .unwrap()
                .assert_passed();
        }
    }
    // Decode-sized grouped GEMMs (the skinny kernel's runs of 1 and of 4 rows).
    for (i, rows) in [vec![2, 0, 5, 1], vec![40, 0, 30, 1, 6]]
        .into_iter()
        .enumerate()
    {
        let case = GemmCase::grouped(rows.clone(), 45, 96, 430 + i as u64);
        run_gemm::<R, F>(client, &case, false)
            .unwrap()
            .assert_passed();
        let bf16_case = GemmCase {
            format: WeightFormat::Bf16,
            ..GemmCase::grouped(rows, 45, 104, 440 + i as u64)
        };
        run_gemm::<R, F>(client, &bf16_case, false)
            .unwrap()
            .assert_passed();
    }
    // Past the grouped skinny limit (1024 rows) and the GEMV's (32 rows per expert on
    // average): the tiled kernel's expert tiles.
    let rows = vec![600, 0, 3, 500, 1];
    let grouped = GemmCase::grouped(rows.clone(), 150, 128, 420);
    run_gemm::<R, F>(client, &grouped, false)
        .unwrap()
        .assert_passed();
    // ... and with weights that tile (fragment layout on CUDA).
    let grouped = GemmCase::grouped(rows.clone(), 160, 128, 422);
    run_gemm::<R, F>(client, &grouped, false)
        .unwrap()
        .assert_passed();
    let grouped_bf16 = GemmCase {
        format: WeightFormat::Bf16,
        ..GemmCase::grouped(rows, 150, 128, 421)
    };
    run_gemm::<R, F>(client, &grouped_bf16, false)
        .unwrap()
        .assert_passed();
}

/// Shapes whose NVFP4 weights tile (N % 16 == 0, K % 64 == 0): on CUDA the fragment layout
/// and the tensor-core GEMV (1 to 8 token groups, partial groups, K split over warps; runs
/// of one expert's rows of 8, and of up to 32 where experts average more than 8 rows, and
/// past that the tiled kernel), elsewhere the other kernels on the same cases.
fn tiled_weight_shapes<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    let dense = (
        1usize..=64,
        1usize..=12,
        1usize..=6,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(m, tiles, chunks, bf16, seed)| {
            with_bf16_weights(GemmCase::dense(m, 16 * tiles, 64 * chunks, seed), bf16)
        });
    gemm_cases::<R, F>(client, dense);
    let grouped = (
        prop::collection::vec(0usize..=40, 1..=5),
        1usize..=4,
        1usize..=3,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_filter("at least one row", |(rows, ..)| {
            rows.iter().sum::<usize>() > 0
        })
        .prop_map(|(rows, tiles, chunks, bf16, seed)| {
            with_bf16_weights(GemmCase::grouped(rows, 16 * tiles, 64 * chunks, seed), bf16)
        });
    gemm_cases::<R, F>(client, grouped);
}

/// `case` with bf16 weights instead of NVFP4 when `bf16`.
fn with_bf16_weights(case: GemmCase, bf16: bool) -> GemmCase {
    let format = if bf16 {
        WeightFormat::Bf16
    } else {
        case.format
    };
    GemmCase { format, ..case }
}

/// On a device with tensor cores, tiling NVFP4 weights are uploaded as fragments and decode
/// GEMMs over them take the tensor-core GEMV; elsewhere they stay row-major.
fn fragment_weights_take_the_gemv<R: Runtime>(client: &ComputeClient<R>) {
    let w: Vec<f32> = (0..32 * 128)
        .map(|i| ((i * 37) % 11) as f32 - 5.0)
        .collect();
    let weights = upload_weights(client, &[Nvfp4Matrix::quantize(&w, 32, 128).unwrap()]);
    let expected = nvfp4_layout(client, 32, 128, Precision::Bf16);
    assert_eq!(weights.layout, expected);
    if expected == Nvfp4Layout::Fragments {
        assert_eq!(
            weights.path(client, 1, false, Precision::Bf16),
            GemmPath::Gemv
        );
        assert_eq!(
            weights.path(client, GEMV_MAX_M_NVFP4, false, Precision::Bf16),
            GemmPath::Gemv
        );
        assert_eq!(
            weights.path(client, GEMV_MAX_M_NVFP4 + 1, false, Precision::Bf16),
            GemmPath::TensorCores
        );
        // Grouped: the GEMV while experts average up to 32 rows (one expert here), then the
        // tiled kernel (the skinny one cannot read fragments).
        assert_eq!(
            weights.path(client, 32, true, Precision::Bf16),
            GemmPath::Gemv
        );
        assert_eq!(
            weights.path(client, 33, true, Precision::Bf16),
            GemmPath::TensorCores
        );
    } else {
        eprintln!("SKIP fragment_weights_take_the_gemv: no bf16 tensor cores here");
    }
}

/// The device re-layout equals the host map, word for word (scale re-encoding and zero-scale
/// blocks included), and the host inverse restores the row-major buffers, whose zero-scale
/// blocks come back with zero codes (two experts, several row and column tiles).
fn fragment_relayout_matches_the_host_map<R: Runtime>(client: &ComputeClient<R>) {
    let (experts, n, k) = (2, 48, 192);
    let mut rng = Rng::new(77);
    let codes: Vec<u32> = (0..experts * n * k / 8)
        .map(|_| rng.next_u64() as u32)
        .collect();
    let scales: Vec<u8> = (0..experts * n * k / 16)
        .map(|_| (rng.next_u64() % 0x7f) as u8)
        .collect();
    let row_major = Nvfp4Weights {
        packed: DeviceArray::upload(client, &codes),
        scales: DeviceArray::upload(client, &kiln_reference::formats::pack_u8_words(&scales)),
        global_scales: DeviceArray::upload(client, &[1.0f32, 2.0]),
        experts,
        n,
        k,
        layout: Nvfp4Layout::RowMajor,
    };
    let device = to_fragments(client, &row_major).unwrap();
    assert_eq!(device.layout, Nvfp4Layout::Fragments);
    let (host_codes, host_scales) = to_fragments_host(&codes, &scales, experts, n, k);
    assert_eq!(device.packed.read(client), host_codes);
    assert_eq!(
        device.scales.read(client),
        kiln_reference::formats::pack_u8_words(&host_scales)
    );
    let (back_codes, back_scales) = from_fragments_host(&host_codes, &host_scales, experts, n, k);
    assert_eq!(back_scales, scales);
    for (i, (&back, &orig)) in back_codes.iter().zip(&codes).enumerate() {
        // Word i holds elements 8i..8i + 8: one block's half.
        let expected = if scales[i / 2] == 0 { 0 } else { orig };
        assert_eq!(back, expected, "word {i}");
    }
}

/// SwiGLU pairs (`gated_gemm`), dense and grouped, both weight formats: shapes the
/// tensor-core GEMV takes on CUDA (NVFP4 N % 16 == 0, K % 64 == 0, M up to 24 dense; bf16
/// K % 64 == 0, any N, M up to 16 dense; up to 32 rows per expert grouped) and shapes it does
/// not (odd N or K, M past those), which run the two GEMMs and `silu_mul`.
fn gated_pairs_match_the_reference<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    let gemv_dense = (
        1usize..=24,
        1usize..=5,
        1usize..=3,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(m, tiles, steps, bf16, seed)| {
            let case = if bf16 {
                GemmCase::bf16(m, 16 * tiles - 3, 64 * steps, seed)
            } else {
                GemmCase::dense(m, 16 * tiles, 64 * steps, seed)
            };
            case.gated()
        });
    gemm_cases::<R, F>(client, gemv_dense);
    let gemv_grouped = (
        prop::collection::vec(0usize..=12, 1..=6),
        1usize..=4,
        1usize..=2,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_filter("at least one row", |(rows, ..)| {
            rows.iter().sum::<usize>() > 0
        })
        .prop_map(|(rows, tiles, steps, bf16, seed)| {
            let case = GemmCase::grouped(rows, 16 * tiles, 64 * steps, seed);
            with_bf16_weights(case, bf16).gated()
        });
    gemm_cases::<R, F>(client, gemv_grouped);
    gemm_cases::<R, F>(client, dense_cases().prop_map(GemmCase::gated));
    gemm_cases::<R, F>(client, grouped_cases().prop_map(GemmCase::gated));
    // 104 and 123 rows over 5 experts: the GEMV's runs of 3 and 4 token groups.
    for (i, rows) in [vec![30, 25, 0, 32, 17], vec![32, 31, 28, 0, 32]]
        .into_iter()
        .enumerate()
    {
        for bf16 in [false, true] {
            let case = GemmCase::grouped(rows.clone(), 48, 128, 60 + i as u64);
            run_gemm::<R, F>(client, &with_bf16_weights(case, bf16).gated(), false)
                .unwrap()
                .assert_passed();
        }
    }
}

/// A gate and an up that differ in shape, M = 0 and a short output are refused before
/// anything launches (or any scratch is sized from M).
fn bad_gated_inputs_are_typed_errors<R: Runtime>(client: &ComputeClient<R>) {
    let gate = tiny_weights(client, 4, 32);
    let up = tiny_weights(client, 8, 32);
    let a = DeviceArray::upload(client, &[1.0f32; 64]);
    let out = DeviceArray::filled(client, 4, f32::NAN);
    let pair = |up: &Nvfp4Weights, m: usize, out: &DeviceArray<f32>| {
        gated_gemm(
            client,
            &a,
            m,
            Operand::Nvfp4(&gate),
            Operand::Nvfp4(up),
            None,
            out,
            Precision::Bf16,
        )
    };
    assert!(matches!(
        pair(&up, 1, &out),
        Err(KernelError::Mismatch { .. })
    ));
    let same = tiny_weights(client, 4, 32);
    assert!(matches!(
        pair(&same, 0, &out),
        Err(KernelError::Range { what: "M", .. })
    ));
    assert!(matches!(
        pair(&same, 2, &out),
        Err(KernelError::Length {
            what: "output C",
            ..
        })
    ));
    assert!(
        out.read(client).iter().all(|x| x.is_nan()),
        "nothing was written"
    );
}

/// Decode-sized shapes from Kimi-K2, pinned.
fn kimi_decode_shapes<R: Runtime>(client: &ComputeClient<R>) {
    for (m, n, k) in [
        (1, 512, 7168),
        (3, 7168, 256),
        (16, 96, 2048),
        (24, 64, 7168),
    ] {
        run_gemm::<R, f32>(client, &GemmCase::dense(m, n, k, 7), false)
            .unwrap()
            .assert_passed();
    }
}

/// Enough weight tiles for the GEMV to give each cube two (dense, and grouped over 8 working
/// experts, where the H200's 132 SMs x 8 cubes are reached), with an odd tile count so the
/// last cube's second tile is past N; both weight formats.
fn two_tile_cubes_match_the_reference<R: Runtime>(client: &ComputeClient<R>) {
    let dense = GemmCase::dense(1, 16 * 1057, 64, 31);
    let grouped = GemmCase::grouped(vec![1, 2, 1, 3, 1, 1, 2, 1], 16 * 133, 128, 32);
    for case in [dense, grouped] {
        for bf16 in [false, true] {
            let case = with_bf16_weights(case.clone(), bf16);
            run_gemm::<R, f32>(client, &case, false)
                .unwrap()
                .assert_passed();
        }
    }
}

/// The decode kernel at M = 1, 4, 16 (and 3, 9: token slots past M), odd N (a partial last
/// cube), K with an odd number of 32-value vectors, both weight formats.
fn skinny_decode_shapes_match_the_reference<R: Runtime, F: Activation>(client: &ComputeClient<R>) {
    for (i, (m, n, k)) in [
        (1, 37, 96),
        (4, 13, 224),
        (16, 9, 160),
        (3, 5, 32),
        (9, 70, 64),
        (1, 257, 2048),
        (16, 131, 1056),
    ]
    .into_iter()
    .enumerate()
    {
        assert!(kiln_kernels::gemm::takes_skinny(m, k, WeightFormat::Nvfp4));
        run_gemm::<R, F>(client, &GemmCase::dense(m, n, k, 100 + i as u64), false)
            .unwrap()
            .assert_passed();
        run_gemm::<R, F>(client, &GemmCase::bf16(m, n, k + 8, 200 + i as u64), false)
            .unwrap()
            .assert_passed();
    }
    // Just outside the decode kernel: M = 17, and K not a multiple of 32 / 8.
    assert!(!kiln_kernels::gemm::takes_skinny(
        17,
        64,
        WeightFormat::Nvfp4
    ));
    assert!(!kiln_kernels::gemm::takes_skinny(
        4,
        48,
        WeightFormat::Nvfp4
    ));
    assert!(!kiln_kernels::gemm::takes_skinny(4, 12, WeightFormat::Bf16));
    for case in [
        GemmCase::dense(17, 21, 64, 300),
        GemmCase::dense(4, 21, 48, 301),
        GemmCase::bf16(4, 21, 12, 302),
    ] {
        run_gemm::<R, F>(client, &case, false)
            .unwrap()
            .assert_passed();
    }
}

fn tiny_weights<R: Runtime>(client: &ComputeClient<R>, n: usize, k: usize) -> Nvfp4Weights {
    let w: Vec<f32> = (0..n * k).map(|i| 1.0 + (i % 7) as f32).collect();
    upload_weights(client, &[Nvfp4Matrix::quantize(&w, n, k).unwrap()])
}

fn bad_shapes_are_typed_errors<R: Runtime>(client: &ComputeClient<R>) {
    let w = tiny_weights(client, 4, 32);
    let a = DeviceArray::upload(client, &[1.0f32; 64]);
    let out = DeviceArray::filled(client, 8, f32::NAN);
    // M disagrees with A's length.
    assert_eq!(
        nvfp4_gemm(client, &a, 3, &w, &out, Precision::Bf16),
        Err(KernelError::Length {
            what: "activations A",
            expected: 96,
            got: 64
        })
    );
    // Output too short.
    let short = DeviceArray::filled(client, 7, f32::NAN);
    assert!(matches!(
        nvfp4_gemm(client, &a, 2, &w, &short, Precision::Bf16),
        Err(KernelError::Length {
            what: "output C",
            ..
        })
    ));
    // M = 0.
    assert!(matches!(
        nvfp4_gemm(client, &a, 0, &w, &out, Precision::Bf16),
        Err(KernelError::Range { what: "M", .. })
    ));
    // K not a multiple of the scale block.
    let odd_k = Nvfp4Weights {
        k: 24,
        ..tiny_weights(client, 4, 32)
    };
    assert_eq!(
        nvfp4_gemm(client, &a, 2, &odd_k, &out, Precision::Bf16),
        Err(KernelError::Alignment {
            what: "K",
            value: 24,
            multiple: 16
        })
    );
    // Grouped: offsets must have experts + 1 entries.
    let offsets = DeviceArray::upload(client, &[0u32]);
    assert_eq!(
        nvfp4_grouped_gemm(client, &a, 2, &w, &offsets, &out, Precision::Bf16),
        Err(KernelError::Length {
            what: "expert offsets",
            expected: 2,
            got: 1
        })
    );
    // bf16 weights need an even K.
    let odd = Bf16Weights {
        experts: 1,
        data: DeviceArray::upload(client, &[0u32; 6]),
        n: 4,
        k: 3,
    };
    assert_eq!(
        bf16_gemm(client, &a, 1, &odd, &out, Precision::Bf16),
        Err(KernelError::Alignment {
            what: "K (bf16 weights)",
            value: 3,
            multiple: 2
        })
    );
    // A dense launch refuses several experts.
    let two = upload_weights(
        client,
        &[
            Nvfp4Matrix::quantize(&[1.0; 128], 4, 32).unwrap(),
            Nvfp4Matrix::quantize(&[2.0; 128], 4, 32).unwrap(),
        ],
    );
    assert!(matches!(
        nvfp4_gemm(client, &a, 2, &two, &out, Precision::Bf16),
        Err(KernelError::Range { .. })
    ));
}

/// bf16 activations on a device without bf16 storage are refused, not miscomputed.
fn unsupported_dtype_is_a_typed_error<R: Runtime>(client: &ComputeClient<R>) {
    if client
        .properties()
        .supports_type(bf16::as_type_native_unchecked())
    {
        eprintln!("SKIP unsupported_dtype_is_a_typed_error: this device stores bf16");
        return;
    }
    let w = tiny_weights(client, 4, 32);
    let a = DeviceArray::upload(client, &[bf16::ONE; 32]);
    let out = DeviceArray::filled(client, 4, f32::NAN);
    assert!(matches!(
        nvfp4_gemm(client, &a, 1, &w, &out, Precision::Bf16),
        Err(KernelError::Unsupported { .. })
    ));
}

kiln_backends::backend_tests! {
    dense [f32, bf16],
    grouped [f32, bf16],
    bf16_weights [f32, bf16],
    kimi_decode_shapes,
    two_tile_cubes_match_the_reference,
    gated_pairs_match_the_reference [f32, bf16],
    bad_gated_inputs_are_typed_errors,
    skinny_decode_shapes_match_the_reference [f32, bf16],
    tiled_shapes_match_the_reference [f32, bf16],
    tiled_weight_shapes [f32, bf16],
    fragment_weights_take_the_gemv,
    fragment_relayout_matches_the_host_map,
    bad_shapes_are_typed_errors,
    unsupported_dtype_is_a_typed_error,
}
