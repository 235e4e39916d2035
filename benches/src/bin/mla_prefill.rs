//! MLA prefill/extend on CUDA in both forms at Kimi's width (64 heads, nope 128, v 128, bf16
//! KV, page 64): 8k new tokens with no prefix and on a 24k prefix, the problems
//! `mla_peer.py` gives PyTorch's SDPA. The absorbed form (`mla_prefill`: 576 + 512 products
//! per head and visible position) against the per-head form (`mla_prefill_heads`, timed
//! whole: context rows read out of the cache, expanded by `kv_b_proj`, rounded to bf16,
//! then attention over head dims 192/128), the context whole and in chunks of 8k rows (how
//! the engine bounds the expansion's memory), and the expansion GEMM alone (its share of
//! the per-head time). TFLOP/s counts what SDPA is credited with (visible pairs x 2 x heads
//! x (192 + 128)) for every form, so kiln's ms against SDPA's ms from the same run is the
//! ratio.
//!
//! The per-head output is validated before it is timed: head 0 of the last query token
//! (and of the first, where it sees few positions) against `kiln_reference::mla_heads`
//! from the cache rows regenerated on the host, under `attention_allowed` with bf16
//! operands. Timing: `kiln_benches::device_time`. Prints a table, writes JSON to the first
//! argument.

kiln_benches::cuda_main!(prefill::run, "times the CUDA MLA prefill kernels");

#[cfg(feature = "cuda")]
mod prefill {
    use std::time::Duration;

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use kiln_benches::device_time::{Client, SpinTimer};
    use kiln_benches::report::{fixed, report};
    use kiln_benches::{fill_kv_cache, kv_cache_row};
    use kiln_kernels::gemm::{bf16_gemm, Bf16Weights};
    use kiln_kernels::mla::{self, AttnMetadata, ContextRows, KvBShape, KvFormat, PagedKvCache};
    use kiln_kernels::{DeviceArray, Precision};
    use kiln_reference::absorb::KvB;
    use kiln_reference::data::{normal_with_outliers, Rng};
    use kiln_reference::formats::{bf16_encode, bf16_round, pack_u16_words};
    use kiln_reference::mla::{AttnBatch, PagedKv, KV_DIM, KV_LORA_RANK};
    use kiln_reference::mla_heads::mla_attention_heads;
    use kiln_reference::tolerance::{attention_allowed, compare, gamma, DType};

    const PAGE: usize = 64;
    const HEADS: usize = 64;
    const NOPE: usize = 128;
    const V: usize = 128;
    const SEED: u32 = 0x6d6c_6101;
    const SCALE: f32 = 0.1;

    #[derive(serde::Serialize)]
    struct Point {
        form: &'static str,
        q_len: usize,
        context: usize,
        ms: f64,
        tflops: f64,
        max_err_over_allowed: Option<f64>,
    }

    /// One request of `q_len` new tokens at the end of `ctx` positions, pages in order.
    fn meta(client: &Client, q_len: usize, ctx: usize) -> AttnMetadata {
        let pages = ctx.div_ceil(PAGE);
        AttnMetadata {
            batch: 1,
            num_tokens: q_len,
            max_q_len: q_len,
            max_kv_len: ctx,
            cu_q_lens: DeviceArray::upload(client, &[0, q_len as u32]),
            kv_lens: DeviceArray::upload(client, &[ctx as u32]),
            block_table: DeviceArray::upload(client, &(0..pages as u32).collect::<Vec<_>>()),
            max_blocks: pages,
            tree_masks: None,
        }
    }

    /// max |err| / allowed of head 0 of the checked tokens.
    fn validate(
        q: &[f32],
        out: &[f32],
        weight: &[f32],
        q_len: usize,
        ctx: usize,
    ) -> anyhow::Result<f64> {
        let pages = ctx.div_ceil(PAGE);
        let kv = PagedKv {
            page_size: PAGE,
            num_pages: pages,
            rows: (0..pages * PAGE)
                .flat_map(|r| kv_cache_row(KvFormat::Bf16, r, SEED))
                .collect(),
        };
        let width = NOPE + 64;
        // Head 0's rows of kv_b_proj: a one-head model of the same head.
        let kvb = KvB {
            weight: &weight[..(NOPE + V) * KV_LORA_RANK],
            heads: 1,
            nope: NOPE,
            v: V,
            kv_lora: KV_LORA_RANK,
        };
        let tokens = if ctx - q_len < 4096 {
            vec![0, q_len - 1]
        } else {
            vec![q_len - 1]
        };
        let (mut actual, mut expected, mut allowed) = (Vec::new(), Vec::new(), Vec::new());
        for i in tokens {
            let visible = ctx - q_len + i + 1;
            let batch = AttnBatch {
                q_lens: vec![1],
                kv_lens: vec![visible],
                block_tables: vec![(0..visible.div_ceil(PAGE) as u32).collect()],
                trees: Vec::new(),
            };
            let row = i * HEADS;
            let r =
                mla_attention_heads(&q[row * width..(row + 1) * width], &kv, &batch, &kvb, SCALE);
            let (s, v) = (r.score_magnitude[0], r.value_magnitude[0]);
            let bound = attention_allowed(
                KV_LORA_RANK + width,
                visible,
                s,
                v,
                DType::BF16,
                DType::F32,
                DType::F32,
            ) + (gamma(KV_LORA_RANK + 2, DType::F32) + DType::BF16.unit_roundoff()) * v;
            allowed.extend(std::iter::repeat_n(bound, V));
            actual.extend_from_slice(&out[row * V..(row + 1) * V]);
            expected.extend(r.out);
        }
        let cmp = compare(&actual, &expected, &allowed);
        anyhow::ensure!(cmp.passed(), "per-head q={q_len} ctx={ctx}: {cmp}");
        Ok(cmp.worst_ratio)
    }

    /// Device ms per call of `launch`, a few calls behind the spin.
    fn time_ms(timer: &SpinTimer, mut launch: impl FnMut()) -> anyhow::Result<f64> {
        launch();
        let timed = timer.time(3, |_| launch());
        anyhow::ensure!(
            timed.enqueue < timed.spin,
            "enqueue ({:.6} s) outlasted the spin ({:.6} s)",
            timed.enqueue,
            timed.spin
        );
        Ok(timed.per_launch * 1e3)
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let shape = KvBShape {
            heads: HEADS,
            nope: NOPE,
            v: V,
        };
        anyhow::ensure!(
            mla::heads_on_tensor_cores(&client, KvFormat::Bf16, Precision::Bf16, shape),
            "this device lacks bf16 mma.sync: the tensor-core kernels would not run"
        );
        let timer = SpinTimer::new(&client, Duration::from_millis(4));
        let mut rng = Rng::new(2026_12_07);
        let weight: Vec<f32> =
            normal_with_outliers(&mut rng, HEADS * (NOPE + V) * KV_LORA_RANK, 0.05)
                .iter()
                .map(|&w| bf16_round(w))
                .collect();
        let bits: Vec<u16> = weight.iter().map(|&w| bf16_encode(w)).collect();
        let kv_b = DeviceArray::upload(&client, &pack_u16_words(&bits));
        let mut points = Vec::new();
        for (q_len, ctx) in [(8192, 8192), (8192, 32768)] {
            let pages = ctx.div_ceil(PAGE);
            let data =
                DeviceArray::<u32>::uninit(&client, pages * PAGE * KvFormat::Bf16.words_per_row());
            fill_kv_cache(&client, &data, KvFormat::Bf16, SEED)?;
            let cache = PagedKvCache {
                data,
                format: KvFormat::Bf16,
                page_size: PAGE,
                num_pages: pages,
            };
            let meta = meta(&client, q_len, ctx);
            let pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2;
            let flops = 2.0 * (HEADS * pairs * (NOPE + 64 + V)) as f64;
            let mut push = |form, ms: f64, err| {
                eprintln!("done {form} q={q_len} ctx={ctx}: {ms:.2} ms");
                points.push(Point {
                    form,
                    q_len,
                    context: ctx,
                    ms,
                    tflops: flops / (ms * 1e-3) / 1e12,
                    max_err_over_allowed: err,
                });
            };

            // Per head: validated, then timed whole.
            let q = normal_with_outliers(&mut rng, q_len * HEADS * (NOPE + 64), 1.0);
            let q_dev = DeviceArray::upload(&client, &q);
            let out = DeviceArray::filled(&client, q_len * HEADS * V, f32::NAN);
            for (form, chunk_rows) in [("per-head", usize::MAX), ("per-head 8k chunks", 8192)] {
                let context = ContextRows::new(&client, &[ctx], chunk_rows);
                let per_head = || {
                    mla::mla_prefill_heads(
                        &client,
                        &q_dev,
                        &cache,
                        &meta,
                        &context,
                        &kv_b,
                        shape,
                        SCALE,
                        &out,
                        Precision::Bf16,
                    )
                    .expect("validated shapes")
                };
                per_head();
                let worst = validate(&q, &out.read(&client), &weight, q_len, ctx)?;
                push(form, time_ms(&timer, per_head)?, Some(worst));
            }

            // Its expansion GEMM alone: [ctx, 512] x [512, heads * 256].
            let latent = DeviceArray::upload(
                &client,
                &normal_with_outliers(&mut rng, ctx * KV_LORA_RANK, 1.0),
            );
            let expanded = DeviceArray::<f32>::uninit(&client, ctx * HEADS * (NOPE + V));
            let weights = Bf16Weights {
                data: kv_b.clone(),
                experts: 1,
                n: HEADS * (NOPE + V),
                k: KV_LORA_RANK,
            };
            let gemm = || {
                bf16_gemm(&client, &latent, ctx, &weights, &expanded, Precision::Bf16)
                    .expect("validated shapes")
            };
            push("expansion GEMM", time_ms(&timer, gemm)?, None);
            drop((q_dev, out, latent, expanded));

            // Absorbed (validated by `mla_decode`'s prefill points).
            let q = DeviceArray::upload(
                &client,
                &normal_with_outliers(&mut rng, q_len * HEADS * KV_DIM, 1.0),
            );
            let out = DeviceArray::<f32>::uninit(&client, q_len * HEADS * 512);
            let absorbed = || {
                mla::mla_prefill(
                    &client,
                    &q,
                    HEADS,
                    &cache,
                    &meta,
                    SCALE,
                    &out,
                    Precision::Bf16,
                )
                .expect("validated shapes")
            };
            push("absorbed", time_ms(&timer, absorbed)?, None);
        }
        report(
            &[
                ("form", 18),
                ("q", 5),
                ("ctx", 6),
                ("ms", 8),
                ("TFLOP/s", 8),
                ("err/tol", 8),
            ],
            &points,
            |p| {
                vec![
                    p.form.to_string(),
                    p.q_len.to_string(),
                    p.context.to_string(),
                    fixed(p.ms, 2),
                    fixed(p.tflops, 1),
                    p.max_err_over_allowed
                        .map_or("-".to_string(), |e| fixed(e, 3)),
                ]
            },
            std::env::args().nth(1),
        )
    }
}
