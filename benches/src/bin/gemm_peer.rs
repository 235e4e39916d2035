//! kiln's bf16-weight GEMM against cuBLAS (through cudarc) on Kimi-K2's bf16 projection
//! shapes at decode batch sizes: `C[M, N] = A[M, K] W[N, K]^T`, bf16 A and W on both sides.
//! Validates kiln's result against the reference first, then times 20 back-to-back launches
//! of each (weights rotated over several copies so the 50 MB L2 cannot hold them) and
//! reports GB/s of weights + activations, the fraction of 4.3 TB/s, and the time ratio.
//! CUDA only.

kiln_benches::cuda_main!(peer::run, "compares with cuBLAS");

#[cfg(feature = "cuda")]
mod peer {
    use std::time::Instant;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use cudarc::cublas::{CudaBlas, Gemm};
    use cudarc::driver::CudaContext;
    use half::bf16;
    use kiln_benches::report::{fixed, report};
    use kiln_benches::HBM_BYTES_PER_S;
    use kiln_kernels::gemm::{bf16_gemm, Bf16Weights};
    use kiln_kernels::{DeviceArray, Precision};
    use kiln_reference::data::{normal_with_outliers, Rng};
    use kiln_reference::formats::{bf16_encode, pack_u16_words};
    use kiln_reference::gemm::{gemm_nt, gemm_nt_magnitude};
    use kiln_reference::tolerance::{compare, DType, Tolerance};

    const SHAPES: [(&str, usize, usize); 6] = [
        ("q_a_proj", 1536, 7168),
        ("q_b_proj", 12288, 1536),
        ("kv_a_proj", 576, 7168),
        ("o_proj", 7168, 8192),
        ("shared gate", 2048, 7168),
        ("shared down", 7168, 2048),
    ];
    const ITERS: usize = 20;

    #[derive(serde::Serialize)]
    struct Row {
        name: &'static str,
        m: usize,
        n: usize,
        k: usize,
        kiln_us: f64,
        cublas_us: f64,
        kiln_gbps: f64,
        cublas_gbps: f64,
        kiln_over_cublas: f64,
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let ctx = CudaContext::new(0)?;
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        let mut rows = Vec::new();
        for (name, n, k) in SHAPES {
            let w_bytes = n * k * 2;
            let copies = (200_000_000 / w_bytes).clamp(1, 8);
            let mut rng = Rng::new(n as u64 * 31 + k as u64);
            let w: Vec<f32> = normal_with_outliers(&mut rng, n * k, 0.02);
            let w_bits: Vec<u16> = w.iter().map(|&x| bf16_encode(x)).collect();
            let w_exact: Vec<f32> = w_bits
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect();
            let ours: Vec<Bf16Weights> = (0..copies)
                .map(|_| Bf16Weights {
                    data: DeviceArray::upload(&client, &pack_u16_words(&w_bits)),
                    experts: 1,
                    n,
                    k,
                })
                .collect();
            let w_half: Vec<bf16> = w_bits.iter().map(|&b| bf16::from_bits(b)).collect();
            let theirs = (0..copies)
                .map(|_| stream.clone_htod(&w_half))
                .collect::<Result<Vec<_>, _>>()?;
            for m in [1usize, 8, 32] {
                let a: Vec<bf16> = normal_with_outliers(&mut rng, m * k, 1.0)
                    .iter()
                    .map(|&x| bf16::from_f32(x))
                    .collect();
                let a_exact: Vec<f32> = a.iter().map(|x| x.to_f32()).collect();
                let a_dev = DeviceArray::upload(&client, &a);
                let out = DeviceArray::filled(&client, m * n, f32::NAN);
                bf16_gemm(&client, &a_dev, m, &ours[0], &out, Precision::Bf16)?;
                let want = gemm_nt(&a_exact, &w_exact, m, n, k);
                let mag = gemm_nt_magnitude(&a_exact, &w_exact, m, n, k);
                let tol = Tolerance::dot(k, DType::F32, DType::F32);
                let cmp = compare(&out.read(&client), &want, &tol.allowed_all(&want, &mag));
                anyhow::ensure!(
                    cmp.passed(),
                    "{name} M={m}: kiln disagrees with the reference: {cmp}"
                );

                let kiln_s = time(|| {
                    for i in 0..ITERS {
                        bf16_gemm(&client, &a_dev, m, &ours[i % copies], &out, Precision::Bf16)
                            .expect("validated");
                    }
                    cubecl::future::block_on(client.sync()).expect("sync");
                });
                let a_cu = stream.clone_htod(&a)?;
                let mut c_cu = stream.alloc_zeros::<bf16>(m * n)?;
                let cfg = kiln_benches::cublas_bf16_nt(m, n, k);
                // SAFETY: buffers hold [n, k], [m, k] and [m, n] bf16 values as the config says.
                let gemm = |i: usize, c: &mut cudarc::driver::CudaSlice<bf16>| unsafe {
                    blas.gemm(cfg, &theirs[i % copies], &a_cu, c)
                        .expect("cuBLAS gemm")
                };
                gemm(0, &mut c_cu);
                stream.synchronize()?;
                let cublas_s = time(|| {
                    for i in 0..ITERS {
                        gemm(i, &mut c_cu);
                    }
                    stream.synchronize().expect("sync");
                });
                let bytes = (w_bytes + m * k * 2) as f64;
                let (kiln_us, cublas_us) =
                    (kiln_s * 1e6 / ITERS as f64, cublas_s * 1e6 / ITERS as f64);
                rows.push(Row {
                    name,
                    m,
                    n,
                    k,
                    kiln_us,
                    cublas_us,
                    kiln_gbps: bytes / (kiln_us * 1e-6) / 1e9,
                    cublas_gbps: bytes / (cublas_us * 1e-6) / 1e9,
                    kiln_over_cublas: kiln_us / cublas_us,
                });
            }
        }
        report(
            &[
                ("projection", 12),
                ("M", 3),
                ("N", 6),
                ("K", 6),
                ("kiln us", 10),
                ("cuBLAS us", 10),
                ("kiln GB/s", 9),
                ("%peak", 6),
                ("cuBLAS", 9),
                ("%peak", 6),
                ("ratio", 8),
            ],
            &rows,
            |r| {
                vec![
                    r.name.to_string(),
                    r.m.to_string(),
                    r.n.to_string(),
                    r.k.to_string(),
                    fixed(r.kiln_us, 1),
                    fixed(r.cublas_us, 1),
                    fixed(r.kiln_gbps, 0),
                    fixed(r.kiln_gbps * 1e9 / HBM_BYTES_PER_S * 100.0, 1),
                    fixed(r.cublas_gbps, 0),
                    fixed(r.cublas_gbps * 1e9 / HBM_BYTES_PER_S * 100.0, 1),
                    fixed(r.kiln_over_cublas, 1),
                ]
            },
            std::env::args().nth(1),
        )
    }

    fn time(mut f: impl FnMut()) -> f64 {
        f(); // warm-up (compilation, handles)
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64()
    }
}
