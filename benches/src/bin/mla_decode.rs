//! MLA decode attention (absorbed form, paged KV, page 64) on CUDA: effective KV bandwidth
//! for 16 and 64 heads, batch 1-64, contexts 8k-128k (batch 64 up to 48k: the kernels index
//! a cache of at most 4 GiB), bf16 and fp8 KV, plus draft
//! verification (several query tokens per request) and prefill/extend (8k new tokens, with
//! and without a 24k cached prefix, through `mla_prefill`) in TFLOP/s (causal: visible
//! query-position pairs x 2 x heads x 1088).
//!
//! Every point is validated before it is timed: for the last request of the batch, the
//! first and last heads of every query token are recomputed by the reference
//! (`kiln_reference::mla::mla_attention`) from KV rows regenerated on the host (the device
//! fills the cache with `kiln_benches::fill_kv_cache`, whose rows `kv_cache_row`
//! recomputes), under `attention_allowed` with the kernel's operand type. Timing:
//! `kiln_benches::device_time` (launches queued behind a spin kernel). The cache is replicated so that consecutive
//! launches read different copies (>= 256 MB in all): L2 never holds the next launch's KV.
//! Effective bandwidth = KV bytes of the visible rows (1152 per token for bf16, 656 for
//! fp8) / time, against the 4.30 TB/s copy ceiling; FLOPs = 2 * heads * q * (576 + 512) per
//! visible KV row. Prints a table, writes JSON to the first argument.

kiln_benches::cuda_main!(decode::run, "times the CUDA tensor-core kernel");

#[cfg(feature = "cuda")]
mod decode {
    use std::time::Duration;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use kiln_benches::device_time::{Client, SpinTimer};
    use kiln_benches::report::{fixed, report};
    use kiln_benches::{fill_kv_cache, kv_cache_row, HBM_BYTES_PER_S};
    use kiln_kernels::mla::{self, AttnMetadata, KvFormat, PagedKvCache};
    use kiln_kernels::{DeviceArray, Precision};
    use kiln_reference::data::{normal_with_outliers, Rng};
    use kiln_reference::mla::{mla_attention, AttnBatch, PagedKv, KV_DIM};
    use kiln_reference::tolerance::{attention_allowed, compare, DType};

    const PAGE: usize = 64;
    const SEED: u32 = 0x6d6c_6100;

    #[derive(serde::Serialize)]
    struct Point {
        kv: &'static str,
        heads: usize,
        batch: usize,
        q_len: usize,
        context: usize,
        us: f64,
        tbps: f64,
        frac_of_copy: f64,
        tflops: f64,
        tokens_per_s: f64,
        max_err_over_allowed: f64,
    }

    struct Setup {
        cache: PagedKvCache,
        metas: Vec<AttnMetadata>,
        tables: Vec<Vec<u32>>,
    }

    fn setup(client: &Client, format: KvFormat, batch: usize, q_len: usize, ctx: usize) -> Setup {
        let pages_per_req = ctx.div_ceil(PAGE);
        let bytes_per_copy = batch * ctx * format.words_per_row() * 4;
        let copies = 256_000_000usize.div_ceil(bytes_per_copy).clamp(1, 32);
        let num_pages = copies * batch * pages_per_req;
        let data = DeviceArray::<u32>::uninit(client, num_pages * PAGE * format.words_per_row());
        fill_kv_cache(client, &data, format, SEED).expect("cache fits u32 indexing");
        let mut metas = Vec::new();
        let mut tables = Vec::new();
        for copy in 0..copies {
            // Request b of copy c owns pages interleaved across the pool.
            let table: Vec<u32> = (0..batch * pages_per_req)
                .map(|i| {
                    let (b, p) = (i / pages_per_req, i % pages_per_req);
                    ((p * batch + b) * copies + copy) as u32
                })
                .collect();
            let cu: Vec<u32> = (0..=batch as u32).map(|b| b * q_len as u32).collect();
            metas.push(AttnMetadata {
                batch,
                num_tokens: batch * q_len,
                max_q_len: q_len,
                max_kv_len: ctx,
                cu_q_lens: DeviceArray::upload(client, &cu),
                kv_lens: DeviceArray::upload(client, &vec![ctx as u32; batch]),
                block_table: DeviceArray::upload(client, &table),
                max_blocks: pages_per_req,
                tree_masks: None,
            });
            tables.push(table);
        }
        Setup {
            cache: PagedKvCache {
                data,
                format,
                page_size: PAGE,
                num_pages,
            },
            metas,
            tables,
        }
    }

    /// max |err| / allowed over the first and last heads of the last request's tokens.
    #[allow(clippy::too_many_arguments)]
    fn validate(
        format: KvFormat,
        setup: &Setup,
        q: &[f32],
        out: &[f32],
        heads: usize,
        batch: usize,
        q_len: usize,
        ctx: usize,
        scale: f32,
    ) -> anyhow::Result<f64> {
        let pages_per_req = ctx.div_ceil(PAGE);
        let b = batch - 1;
        let table = &setup.tables[0][b * pages_per_req..(b + 1) * pages_per_req];
        let rows: Vec<f32> = table
            .iter()
            .flat_map(|&page| {
                (0..PAGE).flat_map(move |s| kv_cache_row(format, page as usize * PAGE + s, SEED))
            })
            .collect();
        let kv = PagedKv {
            page_size: PAGE,
            num_pages: pages_per_req,
            rows,
        };
        // Every query token of a short span; first, middle and last of a long one. Each is
        // checked as a one-token request over the positions it sees.
        let tokens: Vec<usize> = if q_len <= 64 {
            (0..q_len).collect()
        } else {
            vec![0, q_len / 2, q_len - 1]
        };
        let picked = [0, heads - 1];
        let (mut actual, mut expected, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
        for &i in &tokens {
            let visible = ctx - q_len + i + 1;
            let attn = AttnBatch {
                q_lens: vec![1],
                kv_lens: vec![visible],
                block_tables: vec![(0..visible.div_ceil(PAGE) as u32).collect()],
                trees: Vec::new(),
            };
            let mut q_sub = Vec::new();
            for &h in &picked {
                let row = (b * q_len + i) * heads + h;
                q_sub.extend_from_slice(&q[row * KV_DIM..(row + 1) * KV_DIM]);
                actual.extend_from_slice(&out[row * 512..(row + 1) * 512]);
            }
            let reference = mla_attention(&q_sub, picked.len(), &kv, &attn, scale);
            for (s, v) in reference
                .score_magnitude
                .iter()
                .zip(&reference.value_magnitude)
            {
                let bound =
                    attention_allowed(KV_DIM, visible, *s, *v, DType::BF16, DType::F32, DType::F32);
                allowed.extend(std::iter::repeat_n(bound, 512));
            }
            expected.extend(reference.out);
        }
        let cmp = compare(&actual, &expected, &allowed);
        anyhow::ensure!(
            cmp.passed(),
            "{format:?} H={heads} B={batch} q={q_len} ctx={ctx}: {cmp}"
        );
        Ok(cmp.worst_ratio)
    }

    #[allow(clippy::too_many_arguments)]
    fn point(
        client: &Client,
        timer: &SpinTimer,
        rng: &mut Rng,
        format: KvFormat,
        heads: usize,
        batch: usize,
        q_len: usize,
        ctx: usize,
    ) -> anyhow::Result<Point> {
        let prefill = q_len > mla::MAX_DECODE_Q_LEN;
        let setup = setup(client, format, batch, q_len, ctx);
        let q = normal_with_outliers(rng, batch * q_len * heads * KV_DIM, 1.0);
        let q_dev = DeviceArray::upload(client, &q);
        let out = DeviceArray::filled(client, batch * q_len * heads * 512, f32::NAN);
        let scale = 0.1f32;
        let launch = |i: usize| {
            let meta = &setup.metas[i % setup.metas.len()];
            if prefill {
                mla::mla_prefill(
                    client,
                    &q_dev,
                    heads,
                    &setup.cache,
                    meta,
                    scale,
                    &out,
                    Precision::Bf16,
                )
            } else {
                mla::mla_decode(
                    client,
                    &q_dev,
                    heads,
                    &setup.cache,
                    meta,
                    scale,
                    &out,
                    Precision::Bf16,
                )
            }
            .expect("validated shapes")
        };
        launch(0);
        let worst = validate(
            format,
            &setup,
            &q,
            &out.read(client),
            heads,
            batch,
            q_len,
            ctx,
            scale,
        )?;
        let row_bytes = format.words_per_row() * 4;
        let bytes = (batch * ctx * row_bytes) as f64;
        // Causal: query i sees ctx - q_len + i + 1 positions.
        let pairs = batch * (q_len * (ctx - q_len) + q_len * (q_len + 1) / 2);
        let flops = 2.0 * (heads * pairs * (576 + 512)) as f64;
        let est = (bytes / 3.0e12).max(flops / 100e12);
        let launches = ((1.5e-3 / est).ceil() as usize).clamp(2, 100);
        for i in 0..setup.metas.len() {
            launch(i);
        }
        let timed = timer.time(launches, launch);
        anyhow::ensure!(
            timed.enqueue < timed.spin,
            "enqueue ({:.6} s) outlasted the spin ({:.6} s)",
            timed.enqueue,
            timed.spin
        );
        let s = timed.per_launch;
        Ok(Point {
            kv: if format == KvFormat::Fp8 {
                "fp8"
            } else {
                "bf16"
            },
            heads,
            batch,
            q_len,
            context: ctx,
            us: s * 1e6,
            tbps: bytes / s / 1e12,
            frac_of_copy: bytes / s / HBM_BYTES_PER_S,
            tflops: flops / s / 1e12,
            tokens_per_s: batch as f64 / s,
            max_err_over_allowed: worst,
        })
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        anyhow::ensure!(
            mla::uses_tensor_cores(&client, KvFormat::Bf16, Precision::Bf16),
            "this device lacks bf16 mma.sync: the tensor-core kernel would not run"
        );
        let timer = SpinTimer::new(&client, Duration::from_millis(4));
        let mut rng = Rng::new(2026_12_03);
        let mut points = Vec::new();
        let decode = [
            (1, 8192),
            (1, 32768),
            (1, 100_000),
            (1, 131_072),
            (8, 32768),
            (8, 100_000),
            (32, 32768),
            (32, 100_000),
            (64, 32768),
            (64, 49152),
        ];
        // `mla_decode OUT.json fp8` runs the fp8 decode points alone, `... bf16` the bf16
        // ones, `... decode` the decode points of both formats; `... decode HEADS BATCH
        // CONTEXT` only that shape (for a profiler).
        let args: Vec<String> = std::env::args().collect();
        let mode = args.get(2).cloned().unwrap_or_default();
        let shape: Option<Vec<usize>> = (args.len() == 6)
            .then(|| args[3..].iter().map(|a| a.parse()).collect())
            .transpose()?;
        let decode_only = ["fp8", "bf16", "decode"].contains(&mode.as_str());
        let formats: &[KvFormat] = match mode.as_str() {
            "fp8" => &[KvFormat::Fp8],
            "bf16" => &[KvFormat::Bf16],
            _ => &[KvFormat::Bf16, KvFormat::Fp8],
        };
        for &format in formats {
            for heads in [16, 64] {
                for &(batch, ctx) in &decode {
                    if shape.as_ref().is_some_and(|s| s[..] != [heads, batch, ctx]) {
                        continue;
                    }
                    let p = point(&client, &timer, &mut rng, format, heads, batch, 1, ctx)?;
                    eprintln!(
                        "done {} H={heads} B={batch} ctx={ctx}: {:.1} us",
                        p.kv, p.us
                    );
                    points.push(p);
                }
            }
        }
        // Draft verification: several query tokens per request.
        for heads in if decode_only { vec![] } else { vec![16, 64] } {
            for q_len in [8, 16, 32, 64] {
                let p = point(
                    &client,
                    &timer,
                    &mut rng,
                    KvFormat::Bf16,
                    heads,
                    8,
                    q_len,
                    32768,
                )?;
                eprintln!("done verify H={heads} q={q_len}: {:.1} us", p.us);
                points.push(p);
            }
        }
        // Prefill / extend: 8k new tokens with and without a cached prefix.
        for (q_len, ctx) in if decode_only {
            vec![]
        } else {
            vec![(8192, 8192), (8192, 32768)]
        } {
            let p = point(&client, &timer, &mut rng, KvFormat::Bf16, 64, 1, q_len, ctx)?;
            eprintln!("done prefill q={q_len} ctx={ctx}: {:.1} us", p.us);
            points.push(p);
        }
        report(
            &[
                ("kv", 5),
                ("H", 3),
                ("B", 3),
                ("q", 3),
                ("ctx", 7),
                ("us", 9),
                ("TB/s", 6),
                ("%copy", 6),
                ("TFLOP/s", 7),
                ("tok/s", 10),
                ("err/tol", 8),
            ],
            &points,
            |p| {
                vec![
                    p.kv.to_string(),
                    p.heads.to_string(),
                    p.batch.to_string(),
                    p.q_len.to_string(),
                    p.context.to_string(),
                    fixed(p.us, 1),
                    fixed(p.tbps, 2),
                    fixed(p.frac_of_copy * 100.0, 1),
                    fixed(p.tflops, 1),
                    fixed(p.tokens_per_s, 0),
                    fixed(p.max_err_over_allowed, 3),
                ]
            },
            std::env::args().nth(1),
        )
    }
}
