//! `kiln generate`: load a model directory, prefill the prompt, decode a completion.
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::args::DeviceArgs;
use crate::embedded;
use cubecl::prelude::*;
use kiln::model::gpu::{Batch, GpuModel, RequestSlice};
use kiln::model::Checkpoint;
use kiln_backends::{with_backend, BackendVisitor, DeviceReport};
use kiln_core::sampling::SamplingRow;

#[derive(Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json, model*.safetensors, tokenizer.json), or an embedded
    /// model's name: kiln-coder (the default) or kiln-tiny-random.
    #[arg(long, value_name = "DIR|NAME")]
    model: Option<PathBuf>,
    /// The prompt, as raw text (no chat template is applied).
    #[arg(long)]
    prompt: String,
    /// Most tokens to generate (stops earlier at an end-of-sequence token).
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus filter: keep the tokens whose larger-logit tokens hold less than this.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Keep the tokens at least this times as likely as the most likely one (0: all).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed of the sampler (tokens are drawn on the device, keyed by seed and position).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    device: DeviceArgs,
    /// Also print the prompt's and the completion's token ids.
    #[arg(long)]
    ids: bool,
}

const PAGE: usize = 64;

struct Generate<'a> {
    args: &'a GenerateArgs,
    ckpt: &'a Checkpoint,
    prompt: Vec<u32>,
}

/// What a generation did.
struct Outcome {
    ids: Vec<u32>,
    prefill_s: f64,
    /// Seconds of each decode step, in order (the first compiles the decode kernels in a
    /// fresh process).
    steps: Vec<f64>,
    /// Kernel launches of one decode step.
    launches: usize,
}

impl Outcome {
    /// The decode speed, the first step apart: what it took, then the later steps'
    /// median and 10th / 90th percentile times and their tokens per second.
    fn decode_report(&self) -> String {
        let Some((first, rest)) = self.steps.split_first() else {
            return "no decode step".into();
        };
        let mut report = format!("first decode step {:.1} ms", first * 1e3);
        if !rest.is_empty() {
            let mut sorted = rest.to_vec();
            sorted.sort_by(f64::total_cmp);
            let at = |q: f64| sorted[((sorted.len() - 1) as f64 * q).round() as usize] * 1e3;
            let total: f64 = rest.iter().sum();
            report += &format!(
                "; then {} steps of {:.2} ms median (p10 {:.2}, p90 {:.2}): {:.1} tokens/s",
                rest.len(),
                at(0.5),
                at(0.1),
                at(0.9),
                rest.len() as f64 / total,
            );
        }
        format!("{report}; {} kernel launches per step", self.launches)
    }
}

impl BackendVisitor for Generate<'_> {
    type Output = anyhow::Result<Outcome>;

    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) -> Self::Output {
        tracing::info!(device = %report.name, "uploading weights");
        let model = GpuModel::load_with(client, self.ckpt, self.args.device.precision.into())?;
        let total = self.prompt.len() + self.args.max_tokens;
        let pages = total.div_ceil(PAGE);
        let pool = model.kv_pool(pages, PAGE, self.args.device.kv_cache_dtype.into());
        let table: Vec<u32> = (0..pages as u32).collect();
        let a = self.args;
        // Each step draws its one token on the device, after its context.
        let step = |tokens: Vec<u32>, kv_len: usize| {
            let slice = RequestSlice {
                tokens,
                kv_len,
                block_table: table[..kv_len.div_ceil(PAGE)].to_vec(),
                tree: None,
            };
            let mut batch = Batch::last_logits(vec![slice]);
            batch.sampling = Some(vec![SamplingRow {
                temperature: a.temperature,
                top_p: a.top_p,
                top_k: a.top_k,
                min_p: a.min_p,
                seed: a.seed,
                position: kv_len as u32,
            }]);
            model.step(&batch, &pool)
        };
        let start = Instant::now();
        let mut next = step(self.prompt.clone(), self.prompt.len())?.tokens[0];
        let prefill_s = start.elapsed().as_secs_f64();
        let mut out = Vec::new();
        let (mut steps, mut launches) = (Vec::new(), 0);
        while out.len() < self.args.max_tokens {
            out.push(next);
            if self.ckpt.spec.eos_token_ids.contains(&next) || out.len() == self.args.max_tokens {
                break;
            }
            let start = Instant::now();
            let decoded = step(vec![next], self.prompt.len() + out.len())?;
            steps.push(start.elapsed().as_secs_f64());
            launches = decoded.launches;
            next = decoded.tokens[0];
        }
        Ok(Outcome {
            ids: out,
            prefill_s,
            steps,
            launches,
        })
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
    anyhow::ensure!(
        args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0,
        "--temperature must be at least 0 and --top-p in (0, 1]"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.min_p),
        "--min-p must be in [0, 1]"
    );
    let kind = args.device.backend()?;
    let embedded::Opened { ckpt, codec, .. } = embedded::open(args.model.as_deref())?;
    let prompt = codec.encode(&args.prompt).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(!prompt.is_empty(), "the prompt encodes to no tokens");
    let outcome = with_backend(
        kind,
        Generate {
            args: &args,
            ckpt: &ckpt,
            prompt: prompt.clone(),
        },
    )??;
    let o = outcome;
    println!("{}", codec.decode(&o.ids).map_err(anyhow::Error::msg)?);
    if args.ids {
        let join = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
        println!("prompt ids: {}", join(&prompt));
        println!("completion ids: {}", join(&o.ids));
    }
    eprintln!(
        "prefill {} tokens in {:.3} s ({:.1} tokens/s; a fresh process compiles its kernels on first use); {}",
        prompt.len(),
        o.prefill_s,
        prompt.len() as f64 / o.prefill_s,
        o.decode_report(),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Outcome;

    fn outcome(steps: Vec<f64>) -> Outcome {
        Outcome {
            ids: vec![],
            prefill_s: 1.0,
            steps,
            launches: 78,
        }
    }

    #[test]
    fn the_first_decode_step_is_reported_apart_from_the_rest() {
        let report = outcome(vec![2.0, 0.010, 0.030, 0.020, 0.040]).decode_report();
        assert_eq!(
            report,
            "first decode step 2000.0 ms; then 4 steps of 30.00 ms median (p10 10.00, \
             p90 40.00): 40.0 tokens/s; 78 kernel launches per step"
        );
        assert_eq!(
            outcome(vec![0.5]).decode_report(),
            "first decode step 500.0 ms; 78 kernel launches per step"
        );
        assert_eq!(outcome(vec![]).decode_report(), "no decode step");
    }
}
