//! kiln's grouped NVFP4 MoE GEMM at Kimi K2's expert shapes (384 experts, top-8; the SwiGLU
//! pair gate + up, `[2048, 7168]` each, through `gated_gemm`, and down `[7168, 2048]`) for 1,
//! 8, 32, 128 and 1024 tokens, on CUDA, against the bandwidth floor over the experts the
//! routing actually touches; the pair also as two grouped GEMMs and `silu_mul` (what the
//! engine ran before `gated_gemm`), timed in the same run.
//!
//! Weights are generated on the device (`fill_random_bits`: any E2M1 nibble, E4M3 block
//! scales with exponents 4..7, global scale 2^-8); each token picks 8 distinct experts
//! uniformly at random (seeded); rows are sorted by expert and the offsets uploaded. Before
//! timing, 64 sampled outputs (row, column) are checked against 64-bit sums of the exact
//! operands (the pair: `silu(gate) * up` of those sums), the weights recomputed on the host
//! from the fill's hash. Timing: `kiln_benches::device_time`. Floor bytes = touched experts x
//! (codes + block scales; both projections for the pair) + activations; GB/s and % of the
//! 4.30 TB/s copy ceiling; the target is >= 75%.
//! Prints a table, writes JSON to the first argument.

kiln_benches::cuda_main!(moe::run, "times the CUDA kernels");

#[cfg(feature = "cuda")]
mod moe {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use half::bf16;
    use kiln_benches::device_time::{Client, SpinTimer};
    use kiln_benches::report::{fixed, report};
    use kiln_benches::{fill_word, HBM_BYTES_PER_S};
    use kiln_kernels::activation::silu_mul;
    use kiln_kernels::fill::fill_random_bits;
    use kiln_kernels::gemm::fragments::to_fragments;
    use kiln_kernels::gemm::{
        gated_gemm, nvfp4_grouped_gemm, nvfp4_layout, Nvfp4Layout, Nvfp4Weights, Operand,
    };
    use kiln_kernels::{DeviceArray, Precision};
    use kiln_reference::activation::silu;
    use kiln_reference::data::Rng;
    use kiln_reference::formats::{e2m1_decode, e4m3_decode};
    use kiln_reference::tolerance::{swiglu_of_sums_allowed, DType, Tolerance};

    const EXPERTS: usize = 384;
    const TOP_K: usize = 8;
    const TOKENS: [usize; 5] = [1, 8, 32, 128, 1024];
    /// (name, N, K, SwiGLU pair) of one expert's projections: gate and up `[2048, 7168]`
    /// each through `gated_gemm`, down `[7168, 2048]`.
    const SHAPES: [(&str, usize, usize, bool); 2] =
        [("gate_up", 2048, 7168, true), ("down", 7168, 2048, false)];
    /// (codes, scales) fill seeds of the gate (or down) weights and of the up weights.
    const SEEDS: (u32, u32) = (0x6d6f_6501, 0x6d6f_6502);
    const UP_SEEDS: (u32, u32) = (0x6d6f_6511, 0x6d6f_6512);
    /// E4M3 scale bytes 0x20..0x3f: exponents 4..7, any mantissa.
    const SCALE_MASKS: (u32, u32) = (0x1f1f_1f1f, 0x2020_2020);
    const GLOBAL: f32 = 1.0 / 256.0;

    #[derive(serde::Serialize)]
    struct Point {
        projection: &'static str,
        tokens: usize,
        rows: usize,
        experts_touched: usize,
        us: f64,
        /// SwiGLU pairs: the same work as two grouped GEMMs and `silu_mul` (3 launches).
        separate_us: Option<f64>,
        floor_us: f64,
        gbps: f64,
        frac_of_copy: f64,
    }

    /// Weight `(row, col)` of expert `e` of the set filled with `seeds`, as the kernel
    /// decodes it.
    fn weight(seeds: (u32, u32), e: usize, row: usize, col: usize, n: usize, k: usize) -> f64 {
        let r = e * n + row;
        let word = fill_word(((r * k + col) / 8) as u32, seeds.0, u32::MAX, 0);
        let code = (word >> (4 * (col % 8))) & 0xf;
        let s_idx = r * (k / 16) + col / 16;
        let s_word = fill_word((s_idx / 4) as u32, seeds.1, SCALE_MASKS.0, SCALE_MASKS.1);
        let scale = (s_word >> (8 * (s_idx % 4))) & 0xff;
        e2m1_decode(code as u8) as f64 * e4m3_decode(scale as u8) as f64 * GLOBAL as f64
    }

    fn weights(client: &Client, seeds: (u32, u32), n: usize, k: usize) -> Nvfp4Weights {
        let packed = DeviceArray::<u32>::uninit(client, EXPERTS * n * k / 8);
        let scales = DeviceArray::<u32>::uninit(client, EXPERTS * n * k / 64);
        fill_random_bits(client, &packed, seeds.0, u32::MAX, 0).expect("fits");
        fill_random_bits(client, &scales, seeds.1, SCALE_MASKS.0, SCALE_MASKS.1).expect("fits");
        let row_major = Nvfp4Weights {
            packed,
            scales,
            global_scales: DeviceArray::upload(client, &[GLOBAL; EXPERTS]),
            experts: EXPERTS,
            n,
            k,
            layout: Nvfp4Layout::RowMajor,
        };
        // The engine's load-time re-layout (the check above reads row-major positions, so it
        // covers the re-layout too).
        match nvfp4_layout(client, n, k, Precision::Bf16) {
            Nvfp4Layout::Fragments => to_fragments(client, &row_major).expect("valid weights"),
            Nvfp4Layout::RowMajor => row_major,
        }
    }

    /// Each token's 8 distinct experts; rows sorted by expert: (row experts, offsets).
    fn route(rng: &mut Rng, tokens: usize) -> (Vec<usize>, Vec<u32>) {
        let mut row_experts = Vec::with_capacity(tokens * TOP_K);
        for _ in 0..tokens {
            let mut picked = BTreeSet::new();
            while picked.len() < TOP_K {
                picked.insert((rng.next_u64() % EXPERTS as u64) as usize);
            }
            row_experts.extend(picked);
        }
        row_experts.sort_unstable();
        let mut offsets = vec![0u32; EXPERTS + 1];
        for &e in &row_experts {
            offsets[e + 1] += 1;
        }
        for e in 0..EXPERTS {
            offsets[e + 1] += offsets[e];
        }
        (row_experts, offsets)
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let timer = SpinTimer::new(&client, Duration::from_millis(3));
        let mut rng = Rng::new(2026_12_03);
        let mut points = Vec::new();
        for (name, n, k, gated) in SHAPES {
            let w = weights(&client, SEEDS, n, k);
            let up = gated.then(|| weights(&client, UP_SEEDS, n, k));
            for tokens in TOKENS {
                let (row_experts, offsets) = route(&mut rng, tokens);
                let m = row_experts.len();
                let a: Vec<bf16> = (0..m * k)
                    .map(|_| bf16::from_f32(rng.uniform_f32() * 4.0 - 2.0))
                    .collect();
                let a_dev = DeviceArray::upload(&client, &a);
                let off_dev = DeviceArray::upload(&client, &offsets);
                let out = DeviceArray::filled(&client, m * n, f32::NAN);
                let launch = || match &up {
                    Some(up) => gated_gemm(
                        &client,
                        &a_dev,
                        m,
                        Operand::Nvfp4(&w),
                        Operand::Nvfp4(up),
                        Some(&off_dev),
                        &out,
                        Precision::Bf16,
                    )
                    .expect("valid shapes"),
                    None => {
                        nvfp4_grouped_gemm(&client, &a_dev, m, &w, &off_dev, &out, Precision::Bf16)
                            .expect("valid shapes")
                    }
                };
                launch();
                let got = out.read(&client);
                let tol = Tolerance::dot(k + 1, DType::F32, DType::F32);
                for i in 0..64 {
                    let (row, col) = ((i * 7919) % m, (i * 104_729) % n);
                    let e = row_experts[row];
                    // (exact sum, sum of |products|) of the gate (or down) and the up.
                    let mut sums = [(0.0f64, 0.0f64); 2];
                    for kk in 0..k {
                        let x = a[row * k + kk].to_f64();
                        for (set, seeds) in [SEEDS, UP_SEEDS].into_iter().enumerate() {
                            if set == 0 || gated {
                                let p = x * weight(seeds, e, col, kk, n, k);
                                sums[set].0 += p;
                                sums[set].1 += p.abs();
                            }
                        }
                    }
                    let [(g, g_mag), (u, u_mag)] = sums;
                    let (exact, allowed) = if gated {
                        (
                            silu(g) * u,
                            swiglu_of_sums_allowed(
                                g,
                                u,
                                tol.allowed(g, g_mag),
                                tol.allowed(u, u_mag),
                            ),
                        )
                    } else {
                        (g, tol.allowed(g, g_mag))
                    };
                    let v = got[row * n + col] as f64;
                    anyhow::ensure!(
                        (v - exact).abs() <= allowed,
                        "{name} tokens={tokens}: out[{row}, {col}] = {v}, reference {exact}"
                    );
                }
                let touched: BTreeSet<usize> = row_experts.iter().copied().collect();
                let sets = if gated { 2 } else { 1 };
                let bytes = sets * touched.len() * (n * k / 2 + n * k / 16) + m * k * 2;
                let est = bytes as f64 / 2.0e12;
                let launches = ((1e-3 / est).ceil() as usize).clamp(2, 100);
                let timed = timer.time(launches, |_| launch());
                anyhow::ensure!(timed.enqueue < timed.spin, "enqueue outlasted the spin");
                let s = timed.per_launch;
                // The unfused SwiGLU over the same operands, timed in the same run.
                let separate_us = match &up {
                    Some(up) => {
                        let (g, u) = (
                            DeviceArray::<f32>::uninit(&client, m * n),
                            DeviceArray::<f32>::uninit(&client, m * n),
                        );
                        let unfused = timer.time(launches, |_| {
                            nvfp4_grouped_gemm(
                                &client,
                                &a_dev,
                                m,
                                &w,
                                &off_dev,
                                &g,
                                Precision::Bf16,
                            )
                            .and_then(|()| {
                                nvfp4_grouped_gemm(
                                    &client,
                                    &a_dev,
                                    m,
                                    up,
                                    &off_dev,
                                    &u,
                                    Precision::Bf16,
                                )
                            })
                            .and_then(|()| silu_mul(&client, &g, &u, &out))
                            .expect("valid shapes")
                        });
                        anyhow::ensure!(
                            unfused.enqueue < unfused.spin,
                            "enqueue outlasted the spin"
                        );
                        Some(unfused.per_launch * 1e6)
                    }
                    None => None,
                };
                points.push(Point {
                    projection: name,
                    tokens,
                    rows: m,
                    experts_touched: touched.len(),
                    us: s * 1e6,
                    separate_us,
                    floor_us: bytes as f64 / HBM_BYTES_PER_S * 1e6,
                    gbps: bytes as f64 / s / 1e9,
                    frac_of_copy: bytes as f64 / s / HBM_BYTES_PER_S,
                });
                eprintln!("done {name} tokens={tokens}: {:.1} us", s * 1e6);
            }
        }
        report(
            &[
                ("proj", 8),
                ("tokens", 6),
                ("rows", 6),
                ("experts", 8),
                ("us", 10),
                ("separate us", 12),
                ("floor us", 9),
                ("GB/s", 8),
                ("%copy", 6),
            ],
            &points,
            |p| {
                vec![
                    p.projection.to_string(),
                    p.tokens.to_string(),
                    p.rows.to_string(),
                    p.experts_touched.to_string(),
                    fixed(p.us, 1),
                    p.separate_us.map_or("-".into(), |us| fixed(us, 1)),
                    fixed(p.floor_us, 1),
                    fixed(p.gbps, 0),
                    fixed(p.frac_of_copy * 100.0, 1),
                ]
            },
            std::env::args().nth(1),
        )
    }
}
