//! kiln's GEMM (`C[M, N] = A[M, K] W[N, K]^T`, bf16 activations) with NVFP4 and bf16
//! weights, against cuBLAS's bf16 GEMM on the same shapes, on CUDA. Usage:
//! `gemm_decode OUT.json [M,M,...]` (default M = 1, 4, 16: decode; 64, 256: mid;
//! 4096, 16384: prefill).
//!
//! For each (N, K, M) it first checks kiln's result against the reference on a sample of
//! output columns and rows (64-bit sums, the f32 accumulation bound), then times:
//! - kiln: `launches` GEMMs queued behind a ~3 ms spin kernel, minus the spin alone
//!   (`kiln_benches::device_time`); the host's enqueue time is checked to end before the spin.
//! - cuBLAS: CUDA events around `launches` GEMMs queued behind a 2 GiB memset.
//!
//! Weights rotate over enough copies (>= 256 MB in all) that the 60 MB L2 never holds the
//! next launch's weights. Effective bandwidth counts weights + block scales + activations
//! (the output is left out), against the 4.30 TB/s copy ceiling. Prints a table and writes
//! JSON to the path given as the first argument.

kiln_benches::cuda_main!(decode::run, "compares with cuBLAS");

#[cfg(feature = "cuda")]
mod decode {
    use std::time::Duration;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use cudarc::cublas::{CudaBlas, Gemm};
    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
    use half::bf16;
    use kiln_benches::device_time::{median, Client, SpinTimer, REPS};
    use kiln_benches::report::{fixed, report};
    use kiln_benches::HBM_BYTES_PER_S;
    use kiln_kernels::gemm::{bf16_gemm, nvfp4_gemm, Bf16Weights, Nvfp4Weights};
    use kiln_kernels::{DeviceArray, Precision};
    use kiln_reference::data::Rng;
    use kiln_reference::nvfp4::Nvfp4Matrix;
    use kiln_reference::tolerance::{DType, Tolerance};

    /// (N, K): Kimi-K2/DeepSeek-V3 decode projections.
    const SHAPES: [(usize, usize); 4] = [(4096, 7168), (7168, 2048), (36864, 7168), (7168, 18432)];
    const DEFAULT_MS: [usize; 3] = [1, 4, 16];
    /// Output rows checked against the reference per (shape, M), at most.
    const SAMPLE_ROWS: usize = 24;
    /// Output columns checked against the reference per (shape, M).
    const SAMPLE_COLS: usize = 97;

    #[derive(serde::Serialize)]
    struct Row {
        weights: &'static str,
        m: usize,
        n: usize,
        k: usize,
        bytes: usize,
        kiln_us: f64,
        kiln_tbps: f64,
        kiln_frac_of_copy: f64,
        kiln_tflops: f64,
        cublas_bf16_us: f64,
        cublas_bf16_tbps: f64,
        cublas_bf16_tflops: f64,
        speedup_over_cublas_bf16: f64,
        launches: usize,
        enqueue_us: f64,
        spin_us: f64,
    }

    /// A weight operand in either format, `copies` times.
    enum Weights {
        Nvfp4(Vec<Nvfp4Weights>, Nvfp4Matrix),
        Bf16(Vec<Bf16Weights>, Vec<u16>),
    }

    impl Weights {
        fn copies(&self) -> usize {
            match self {
                Weights::Nvfp4(w, _) => w.len(),
                Weights::Bf16(w, _) => w.len(),
            }
        }

        fn value(&self, row: usize, col: usize, k: usize) -> f64 {
            match self {
                Weights::Nvfp4(_, q) => q.value(row, col) as f64,
                Weights::Bf16(_, bits) => f32::from_bits((bits[row * k + col] as u32) << 16) as f64,
            }
        }

        fn launch(
            &self,
            client: &Client,
            a: &DeviceArray<bf16>,
            m: usize,
            out: &DeviceArray<f32>,
            i: usize,
        ) {
            let r = match self {
                Weights::Nvfp4(w, _) => {
                    nvfp4_gemm(client, a, m, &w[i % w.len()], out, Precision::Bf16)
                }
                Weights::Bf16(w, _) => {
                    bf16_gemm(client, a, m, &w[i % w.len()], out, Precision::Bf16)
                }
            };
            r.expect("validated shapes");
        }
    }

    /// Random NVFP4 codes, block scales in [2^-3, 2) and a global scale of 2^-8: a valid
    /// matrix without running the quantizer over 264M values.
    fn random_nvfp4(rng: &mut Rng, n: usize, k: usize) -> Nvfp4Matrix {
        let packed = (0..n * k / 2).map(|_| rng.next_u64() as u8).collect();
        // E4M3 codes 0x20..0x3f: exponents 4..7 (2^-3 .. 2^0), any mantissa.
        let scales = (0..n * k / 16)
            .map(|_| 0x20 + (rng.next_u64() % 32) as u8)
            .collect();
        Nvfp4Matrix {
            rows: n,
            cols: k,
            packed,
            scales,
            global_scale: 1.0 / 256.0,
        }
    }

    fn make_weights(
        client: &Client,
        rng: &mut Rng,
        nvfp4: bool,
        n: usize,
        k: usize,
    ) -> (Weights, usize) {
        let bytes = if nvfp4 {
            n * k / 2 + n * k / 16
        } else {
            n * k * 2
        };
        let copies = 256_000_000usize.div_ceil(bytes).clamp(1, 40);
        if nvfp4 {
            let q = random_nvfp4(rng, n, k);
            let packed = q.packed_words();
            let w = (0..copies)
                .map(|_| {
                    Nvfp4Weights::upload(
                        client,
                        &packed,
                        &q.scales,
                        &[q.global_scale],
                        1,
                        n,
                        k,
                        Precision::Bf16,
                    )
                    .expect("a quantized matrix matches its shape")
                })
                .collect();
            (Weights::Nvfp4(w, q), bytes)
        } else {
            // bf16 values in [-2^-4, 2^-4): a random sign, exponent and mantissa.
            let bits: Vec<u16> = (0..n * k)
                .map(|_| 0x3a00 + (rng.next_u64() as u16 & 0x81ff))
                .collect();
            let words = kiln_reference::formats::pack_u16_words(&bits);
            let w = (0..copies)
                .map(|_| Bf16Weights {
                    data: DeviceArray::upload(client, &words),
                    experts: 1,
                    n,
                    k,
                })
                .collect();
            (Weights::Bf16(w, bits), bytes)
        }
    }

    /// Checks sampled output columns (every M row) against 64-bit sums of the exact operands.
    fn validate(
        w: &Weights,
        a: &[bf16],
        out: &[f32],
        m: usize,
        n: usize,
        k: usize,
    ) -> anyhow::Result<()> {
        // Activations are bf16 already, so no kernel rounds an operand; + 1 term for the
        // NVFP4 global scale the tensor-core path applies to the sum.
        let tol = Tolerance::dot(k + 1, DType::F32, DType::F32);
        let cols = (0..SAMPLE_COLS).map(|i| i * (n - 1) / (SAMPLE_COLS - 1));
        let rows: Vec<usize> = if m <= SAMPLE_ROWS {
            (0..m).collect()
        } else {
            (0..SAMPLE_ROWS)
                .map(|i| i * (m - 1) / (SAMPLE_ROWS - 1))
                .collect()
        };
        for col in cols {
            let w_row: Vec<f64> = (0..k).map(|kk| w.value(col, kk, k)).collect();
            for &row in &rows {
                let (mut exact, mut mag) = (0.0f64, 0.0f64);
                for (kk, wv) in w_row.iter().enumerate() {
                    let p = a[row * k + kk].to_f64() * wv;
                    exact += p;
                    mag += p.abs();
                }
                let got = out[row * n + col] as f64;
                let allowed = tol.allowed(exact, mag);
                anyhow::ensure!(
                    (got - exact).abs() <= allowed,
                    "M={m} N={n} K={k}: out[{row}, {col}] = {got}, reference {exact} (allowed {allowed:e})"
                );
            }
        }
        Ok(())
    }

    /// cuBLAS bf16 GEMM seconds per launch, from events around `launches` launches queued
    /// behind a memset.
    fn time_cublas(
        stream: &std::sync::Arc<CudaStream>,
        blas: &CudaBlas,
        blocker: &mut CudaSlice<u8>,
        w: &[CudaSlice<bf16>],
        m: usize,
        n: usize,
        k: usize,
        launches: usize,
    ) -> anyhow::Result<f64> {
        let a = stream.clone_htod(&vec![bf16::from_f32(0.5); m * k])?;
        let mut c = stream.alloc_zeros::<bf16>(m * n)?;
        let cfg = kiln_benches::cublas_bf16_nt(m, n, k);
        let mut times = Vec::new();
        for rep in 0..=REPS {
            stream.memset_zeros(blocker)?;
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            for i in 0..launches {
                // SAFETY: buffers hold [n, k], [m, k] and [m, n] bf16 values as the config says.
                unsafe { blas.gemm(cfg, &w[i % w.len()], &a, &mut c) }?;
            }
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let ms = start.elapsed_ms(&end)? as f64;
            if rep > 0 {
                times.push(ms * 1e-3 / launches as f64);
            }
        }
        Ok(median(times))
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let ctx = CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        let mut blocker = stream.alloc_zeros::<u8>(2 << 30)?;
        let timer = SpinTimer::new(&client, Duration::from_millis(3));
        let mut rng = Rng::new(2026_12_03);
        let ms: Vec<usize> = match std::env::args().nth(2) {
            Some(list) => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
            None => DEFAULT_MS.to_vec(),
        };
        let mut rows = Vec::new();
        for (n, k) in SHAPES {
            // cuBLAS's bf16 weights, rotated like kiln's.
            let cublas_copies = 256_000_000usize.div_ceil(n * k * 2).clamp(1, 40);
            let bits: Vec<bf16> = (0..n * k)
                .map(|_| bf16::from_bits(0x3a00 + (rng.next_u64() as u16 & 0x81ff)))
                .collect();
            let theirs = (0..cublas_copies)
                .map(|_| stream.clone_htod(&bits))
                .collect::<Result<Vec<_>, _>>()?;
            drop(bits);
            let mut cublas_us = std::collections::HashMap::new();
            for &m in &ms {
                let launches = ((0.02 / flops_s(m, n, k, 600e12)).ceil() as usize).clamp(3, 100);
                cublas_us.insert(
                    m,
                    time_cublas(&stream, &blas, &mut blocker, &theirs, m, n, k, launches)? * 1e6,
                );
            }
            drop(theirs);
            for nvfp4 in [true, false] {
                let (w, w_bytes) = make_weights(&client, &mut rng, nvfp4, n, k);
                for &m in &ms {
                    let a: Vec<bf16> = (0..m * k)
                        .map(|_| bf16::from_f32(rng.uniform_f32() * 4.0 - 2.0))
                        .collect();
                    let a_dev = DeviceArray::upload(&client, &a);
                    let out = DeviceArray::filled(&client, m * n, f32::NAN);
                    w.launch(&client, &a_dev, m, &out, 0);
                    validate(&w, &a, &out.read(&client), m, n, k)?;
                    let bytes = w_bytes + m * k * 2;
                    // Enough launches for ~600 us of device work, few enough to enqueue within the spin.
                    let est_s = (bytes as f64 / 3.0e12).max(flops_s(m, n, k, 200e12));
                    let launches = ((600e-6 / est_s).ceil() as usize).clamp(2, 200);
                    for i in 0..w.copies() {
                        w.launch(&client, &a_dev, m, &out, i);
                    }
                    let timed = timer.time(launches, |i| w.launch(&client, &a_dev, m, &out, i));
                    let (per_launch, enqueue, spin_s) =
                        (timed.per_launch, timed.enqueue, timed.spin);
                    anyhow::ensure!(
                        enqueue < spin_s,
                        "enqueue ({enqueue:.6} s) outlasted the spin ({spin_s:.6} s)"
                    );
                    let cu = cublas_us[&m];
                    let kiln_us = per_launch * 1e6;
                    let tbps = bytes as f64 / per_launch / 1e12;
                    rows.push(Row {
                        weights: if nvfp4 { "nvfp4" } else { "bf16" },
                        m,
                        n,
                        k,
                        bytes,
                        kiln_us,
                        kiln_tbps: tbps,
                        kiln_frac_of_copy: tbps * 1e12 / HBM_BYTES_PER_S,
                        kiln_tflops: 2.0 * (m * n * k) as f64 / per_launch / 1e12,
                        cublas_bf16_us: cu,
                        cublas_bf16_tbps: (n * k * 2 + m * k * 2) as f64 / cu / 1e6,
                        cublas_bf16_tflops: 2.0 * (m * n * k) as f64 / cu / 1e6,
                        speedup_over_cublas_bf16: cu / kiln_us,
                        launches,
                        enqueue_us: enqueue * 1e6,
                        spin_us: spin_s * 1e6,
                    });
                    eprintln!(
                        "done {} M={m} N={n} K={k}: {kiln_us:.1} us",
                        rows.last().unwrap().weights
                    );
                }
            }
        }
        report(
            &[
                ("W", 6),
                ("M", 5),
                ("N", 6),
                ("K", 6),
                ("kiln us", 10),
                ("TB/s", 6),
                ("%copy", 6),
                ("TFLOP/s", 7),
                ("cuBLAS us", 10),
                ("TB/s", 6),
                ("TFLOP/s", 7),
                ("speedup", 8),
            ],
            &rows,
            |r| {
                vec![
                    r.weights.to_string(),
                    r.m.to_string(),
                    r.n.to_string(),
                    r.k.to_string(),
                    fixed(r.kiln_us, 2),
                    fixed(r.kiln_tbps, 2),
                    fixed(r.kiln_frac_of_copy * 100.0, 1),
                    fixed(r.kiln_tflops, 1),
                    fixed(r.cublas_bf16_us, 2),
                    fixed(r.cublas_bf16_tbps, 2),
                    fixed(r.cublas_bf16_tflops, 1),
                    fixed(r.speedup_over_cublas_bf16, 2),
                ]
            },
            std::env::args().nth(1),
        )
    }

    /// Seconds for the GEMM's FLOPs at `rate` FLOP/s (a launch-count estimate).
    fn flops_s(m: usize, n: usize, k: usize, rate: f64) -> f64 {
        2.0 * (m * n * k) as f64 / rate
    }
}
