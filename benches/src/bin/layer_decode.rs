//! Per-layer step time of a Kimi-K2-shaped model at full width (weights generated on the
//! device), for decode at several batch sizes and contexts and for an 8k prefill, against
//! the bandwidth floor. A layer's time is the difference between a 3-layer and a 1-layer
//! model's forward, halved, so the embedding, lm_head and host work of a step cancel out.
//! `--tp-rank-of T` times the shapes one rank of TP-T holds, with the modelled all-reduce
//! stand-in `kiln serve --tp-rank-of` uses; `--served-layers N` times instead the whole
//! step of the model `kiln serve --synthetic kimi-k2.6 --layers N` serves (first layer
//! dense, full vocabulary, logits read back): the forward alone beside a serving sweep.
//!
//! The forward is run and its logits read back once before timing (kernel compilation);
//! the KV cache (bf16, or fp8 with `--kv fp8`) is filled with random finite values (never
//! zeros). Prints a table, writes JSON.
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use cubecl::prelude::*;
use kiln::model::gpu::{Batch, GpuModel, KvPool, RequestSlice};
use kiln::model::tp::shard::rank_config;
use kiln_backends::{with_backend, BackendKind, BackendVisitor, DeviceReport};
use kiln_benches::report::{fixed, report};
use kiln_benches::{floor_seconds, fp8_kv_scales, kimi_k2_layers, step_floor_seconds};
use kiln_core::model::ModelConfig;
use kiln_kernels::fill::{fill_random_bits, fill_random_records};
use kiln_kernels::mla::{KvFormat, PER_HEAD_MIN_Q_LEN};

/// Kimi-K2 per-layer decode and prefill timing on the device.
#[derive(Parser)]
struct Args {
    /// Backend: wgpu, cuda or cuda-routed (default: KILN_BACKEND, else cuda if compiled in).
    #[arg(long)]
    backend: Option<String>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Context lengths (tokens already cached per request).
    #[arg(long, value_delimiter = ',', default_value = "8192,32768,100000")]
    contexts: Vec<usize>,
    /// KV cache format: bf16 or fp8 (FlashMLA's row: E4M3 latent, f32 scales, bf16 rope).
    #[arg(long, default_value = "bf16", value_parser = parse_kv)]
    kv: KvFormat,
    /// Prefill length (0 to skip).
    #[arg(long, default_value_t = 8192)]
    prefill: usize,
    /// Timed repetitions per point (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Time one rank of tensor parallelism over T GPUs (`model::tp`'s shapes, all-reduces
    /// stood in for by device work of their modelled time).
    #[arg(long, value_name = "T")]
    tp_rank_of: Option<usize>,
    /// Time whole steps of the first N layers of Kimi K2 with its vocabulary (the model
    /// `kiln serve --synthetic kimi-k2.6 --layers N` serves) instead of one layer.
    #[arg(long, value_name = "N")]
    served_layers: Option<usize>,
    /// Requests prefilling at least N new tokens attend in MLA's per-head form, as
    /// `kiln serve --mla-per-head-from` (0: always absorbed).
    #[arg(long, default_value_t = PER_HEAD_MIN_Q_LEN, value_name = "N")]
    mla_per_head_from: usize,
    /// Replay decode steps from CUDA graphs, one recorded per --batches size (the
    /// `cuda-routed` backend only).
    #[arg(long)]
    graphs: bool,
    /// Write every point as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const PAGE: usize = 64;

fn parse_kv(s: &str) -> Result<KvFormat, String> {
    match s {
        "bf16" => Ok(KvFormat::Bf16),
        "fp8" => Ok(KvFormat::Fp8),
        _ => Err(format!("unknown KV format {s:?} (bf16 or fp8)")),
    }
}

#[derive(serde::Serialize)]
struct Point {
    /// `decode` or `prefill` (one layer's share), `step` (a whole served model's step).
    kind: &'static str,
    kv: &'static str,
    batch: usize,
    context: usize,
    layer_ms: f64,
    floor_ms: f64,
    floor_ratio: f64,
    bytes_gb: f64,
    achieved_gbps: f64,
    tokens_per_s: f64,
    /// Kernel launches per layer, counted by the model.
    launches: f64,
    /// Host time issuing one layer's kernels.
    issue_ms: f64,
}

struct Bench {
    args: Args,
}

impl Bench {
    /// `c`, or one TP rank's share of it.
    fn shapes(&self, c: ModelConfig) -> anyhow::Result<ModelConfig> {
        Ok(match self.args.tp_rank_of {
            Some(t) => rank_config(&c, t)?,
            None => c,
        })
    }

    fn model<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        c: ModelConfig,
        seed: u32,
    ) -> anyhow::Result<GpuModel<R>> {
        let mut m = GpuModel::synthetic(client.clone(), self.shapes(c)?, seed)?;
        m.set_per_head_from(Some(self.args.mla_per_head_from).filter(|&n| n > 0));
        if self.args.graphs {
            m.enable_graphs(self.args.batches.clone())?;
        }
        Ok(match self.args.tp_rank_of {
            Some(t) => m.with_all_reduce_stand_in(t)?,
            None => m,
        })
    }
}

impl BackendVisitor for Bench {
    type Output = anyhow::Result<Vec<Point>>;
    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) -> Self::Output {
        eprintln!("{report}");
        let (kv, reps) = (self.args.kv, self.args.reps);
        let mut points = Vec::new();
        if let Some(n) = self.args.served_layers {
            let m = self.model(&client, ModelConfig::kimi_k2().first_layers(n), 1)?;
            for &b in &self.args.batches {
                for &ctx in &self.args.contexts {
                    let t = step_timing(&m, b, ctx, 1, reps, kv)?;
                    let (bytes, floor) = step_floor_seconds(&m.config, b, b * ctx, kv);
                    points.push(point("step", b, ctx, t, b, bytes, floor, kv));
                    eprintln!("step batch {b} context {ctx}: {:.3} ms", t.ms);
                }
            }
            return Ok(points);
        }
        let one = self.model(&client, kimi_k2_layers(1, 1024), 1)?;
        let three = self.model(&client, kimi_k2_layers(3, 1024), 2)?;
        for &b in &self.args.batches {
            for &ctx in &self.args.contexts {
                let t = layer_timing(&one, &three, b, ctx, 1, reps, kv)?;
                let (bytes, floor) = floor_seconds(&three.config, b, b * ctx, kv);
                points.push(point("decode", b, ctx, t, b, bytes, floor, kv));
                eprintln!("decode batch {b} context {ctx}: {:.3} ms per layer", t.ms);
            }
        }
        if self.args.prefill > 0 {
            let n = self.args.prefill;
            let t = layer_timing(&one, &three, 1, n, n, reps, kv)?;
            let (bytes, floor) = floor_seconds(&three.config, n, n * (n + 1) / 2, kv);
            points.push(point("prefill", 1, n, t, n, bytes, floor, kv));
            eprintln!("prefill {n}: {:.3} ms per layer", t.ms);
        }
        Ok(points)
    }
}

/// One layer's share of a step: milliseconds, launches and host issue time.
#[derive(Clone, Copy)]
struct LayerTiming {
    ms: f64,
    launches: f64,
    issue_ms: f64,
}

#[allow(clippy::too_many_arguments)]
fn point(
    kind: &'static str,
    batch: usize,
    ctx: usize,
    t: LayerTiming,
    tokens: usize,
    bytes: f64,
    floor: f64,
    kv: KvFormat,
) -> Point {
    let ms = t.ms;
    Point {
        kind,
        kv: if kv == KvFormat::Fp8 { "fp8" } else { "bf16" },
        batch,
        context: ctx,
        layer_ms: ms,
        floor_ms: floor * 1e3,
        floor_ratio: ms / (floor * 1e3),
        bytes_gb: bytes / 1e9,
        achieved_gbps: bytes / (ms * 1e-3) / 1e9,
        tokens_per_s: tokens as f64 / (ms * 1e-3),
        launches: t.launches,
        issue_ms: t.issue_ms,
    }
}

/// Per-layer figures for `batch` requests of `context` cached tokens, `new` of them
/// computed in this step.
fn layer_timing<R: Runtime>(
    one: &GpuModel<R>,
    three: &GpuModel<R>,
    batch: usize,
    context: usize,
    new: usize,
    reps: usize,
    kv: KvFormat,
) -> anyhow::Result<LayerTiming> {
    let t1 = step_timing(one, batch, context, new, reps, kv)?;
    let t3 = step_timing(three, batch, context, new, reps, kv)?;
    Ok(LayerTiming {
        ms: (t3.ms - t1.ms) / 2.0,
        launches: (t3.launches - t1.launches) / 2.0,
        issue_ms: (t3.issue_ms - t1.issue_ms) / 2.0,
    })
}

/// Median wall time of whole steps, with the launches and host issue time of the median one.
fn step_timing<R: Runtime>(
    m: &GpuModel<R>,
    batch: usize,
    context: usize,
    new: usize,
    reps: usize,
    kv: KvFormat,
) -> anyhow::Result<LayerTiming> {
    let pages_per = context.div_ceil(PAGE);
    let pool: KvPool = m.kv_pool(batch * pages_per, PAGE, kv);
    // bf16: sign, exponent 0x7e..0x7f (0.5..2); fp8: bytes of at most 0xb7, which no E4M3
    // NaN or bf16 rope value reaches (finite, exponents <= 0x6f), and power-of-two scales.
    for (i, cache) in pool.caches.iter().enumerate() {
        let seed = 7 + i as u32;
        match kv {
            KvFormat::Fp8 => fill_random_records(
                m.client(),
                &cache.data,
                seed,
                (0xb7b7_b7b7, 0),
                &fp8_kv_scales(),
            ),
            _ => fill_random_bits(m.client(), &cache.data, seed, 0x807f_807f, 0x3f00_3f00),
        }?;
    }
    let requests = (0..batch)
        .map(|b| RequestSlice {
            tokens: (0..new).map(|i| ((b * 31 + i * 7) % 1024) as u32).collect(),
            kv_len: context,
            block_table: (b * pages_per..(b + 1) * pages_per)
                .map(|p| p as u32)
                .collect(),
            tree: None,
        })
        .collect();
    let batch = Batch::new(requests);
    m.forward(&batch, &pool).context("warm-up step")?;
    let mut runs = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let out = m.step(&batch, &pool)?;
        runs.push(LayerTiming {
            ms: start.elapsed().as_secs_f64() * 1e3,
            launches: out.launches as f64,
            issue_ms: out.issue_seconds * 1e3,
        });
    }
    runs.sort_by(|a, b| a.ms.total_cmp(&b.ms));
    Ok(runs[runs.len() / 2])
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let kind = BackendKind::choose(args.backend.as_deref())?;
    let json = args.json.clone();
    let points = with_backend(kind, Bench { args })??;
    report(
        &[
            ("kind", 8),
            ("batch", 6),
            ("context", 8),
            ("layer ms", 11),
            ("floor ms", 10),
            ("x floor", 8),
            ("GB", 9),
            ("GB/s", 10),
            ("tokens/s", 12),
            ("launches", 9),
            ("issue ms", 9),
        ],
        &points,
        |p| {
            vec![
                p.kind.to_string(),
                p.batch.to_string(),
                p.context.to_string(),
                fixed(p.layer_ms, 3),
                fixed(p.floor_ms, 3),
                fixed(p.floor_ratio, 1),
                fixed(p.bytes_gb, 2),
                fixed(p.achieved_gbps, 1),
                fixed(p.tokens_per_s, 1),
                fixed(p.launches, 0),
                fixed(p.issue_ms, 3),
            ]
        },
        json,
    )
}
