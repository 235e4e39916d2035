//! `kiln generate`: load a model directory, prefill the prompt, decode a completion.
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::args::DeviceArgs;
use crate::embedded;
use cubecl::prelude::*;
use kiln::model::gpu::{Batch, GpuModel, RequestSlice};
use kiln::model::Checkpoint;
use kiln::sampling::sample;
use kiln_backends::{with_backend, BackendVisitor, DeviceReport};
use kiln_core::rng::Rng;

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
    /// Seed of the sampler.
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
    decode_s: f64,
    /// Kernel launches of one decode step.
    launches: usize,
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
        let vocab = model.config.vocab_size;
        let mut rng = Rng::new(self.args.seed);
        let step = |tokens: Vec<u32>, kv_len: usize| {
            let slice = RequestSlice {
                tokens,
                kv_len,
                block_table: table[..kv_len.div_ceil(PAGE)].to_vec(),
                tree: None,
            };
            model.step(&Batch::new(vec![slice]), &pool)
        };
        let start = Instant::now();
        let logits = step(self.prompt.clone(), self.prompt.len())?.logits;
        let prefill_s = start.elapsed().as_secs_f64();
        let mut next = sample(
            &logits[logits.len() - vocab..],
            self.args.temperature,
            1.0,
            &mut rng,
        );
        let mut out = Vec::new();
        let mut launches = 0;
        let start = Instant::now();
        while out.len() < self.args.max_tokens {
            out.push(next);
            if self.ckpt.spec.eos_token_ids.contains(&next) || out.len() == self.args.max_tokens {
                break;
            }
            let decoded = step(vec![next], self.prompt.len() + out.len())?;
            launches = decoded.launches;
            next = sample(&decoded.logits, self.args.temperature, 1.0, &mut rng);
        }
        Ok(Outcome {
            ids: out,
            prefill_s,
            decode_s: start.elapsed().as_secs_f64(),
            launches,
        })
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.max_tokens > 0, "--max-tokens must be at least 1");
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
    let decoded = o.ids.len().saturating_sub(1);
    eprintln!(
        "prefill {} tokens in {:.3} s ({:.1} tokens/s); decode {} tokens in {:.3} s ({:.1} tokens/s, {} kernel launches per step)",
        prompt.len(),
        o.prefill_s,
        prompt.len() as f64 / o.prefill_s,
        decoded,
        o.decode_s,
        if o.decode_s > 0.0 { decoded as f64 / o.decode_s } else { 0.0 },
        o.launches,
    );
    Ok(())
}
