//! `kiln perplexity`: a model's loss on text files, through the engine's own forward (its
//! kernels, KV cache format and precision), to measure what NVFP4 experts, an fp8 cache or
//! bf16 tensor cores change in what a model predicts.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use cubecl::prelude::*;
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::DeviceArgs;
use crate::embedded;
use kiln::model::gpu::{Batch, GpuModel, RequestSlice};
use kiln::model::Checkpoint;
use kiln_backends::{with_backend, BackendVisitor, DeviceReport};

#[derive(Args)]
pub struct PerplexityArgs {
    /// HF model directory, or an embedded model's name (kiln-coder, the default).
    #[arg(long, value_name = "DIR|NAME")]
    model: Option<PathBuf>,
    /// Text files to score, each tokenized whole (no chat template) and cut into windows.
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Tokens per window: each window is one fresh sequence whose every token after the
    /// first is predicted from those before it.
    #[arg(long, default_value_t = 1024)]
    window: usize,
    /// Stop after scoring this many tokens (0: all of them).
    #[arg(long, default_value_t = 0)]
    max_tokens: usize,
    #[command(flatten)]
    device: DeviceArgs,
    /// Also write the result as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The summed loss over the scored tokens.
struct Score {
    nll: f64,
    tokens: usize,
    seconds: f64,
}

struct Run<'a> {
    args: &'a PerplexityArgs,
    ckpt: &'a Checkpoint,
    windows: Vec<Vec<u32>>,
}

impl BackendVisitor for Run<'_> {
    type Output = anyhow::Result<Score>;

    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) -> Self::Output {
        tracing::info!(device = %report.name, "uploading weights");
        let model = GpuModel::load_with(client, self.ckpt, self.args.device.precision.into())?;
        let page = 64;
        let pages = self.args.window.div_ceil(page);
        let pool = model.kv_pool(pages, page, self.args.device.kv_cache_dtype.into());
        let table: Vec<u32> = (0..pages as u32).collect();
        let vocab = model.config.vocab_size;
        let bar = ProgressBar::new(self.windows.iter().map(Vec::len).sum::<usize>() as u64)
            .with_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} tokens, {per_sec}, eta {eta}")
                    .expect("a valid template"),
            );
        let start = Instant::now();
        let mut score = Score {
            nll: 0.0,
            tokens: 0,
            seconds: 0.0,
        };
        for window in &self.windows {
            let slice = RequestSlice {
                tokens: window.clone(),
                kv_len: window.len(),
                block_table: table[..window.len().div_ceil(page)].to_vec(),
                tree: None,
            };
            let logits = model.step(&Batch::new(vec![slice]), &pool)?.logits;
            for (row, &next) in logits.chunks(vocab).zip(&window[1..]) {
                score.nll += nll(row, next as usize);
                score.tokens += 1;
            }
            bar.inc(window.len() as u64);
        }
        bar.finish_and_clear();
        score.seconds = start.elapsed().as_secs_f64();
        Ok(score)
    }
}

/// `-log softmax(row)[target]`, in f64.
fn nll(row: &[f32], target: usize) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    sum.ln() + max - row[target] as f64
}

/// Cuts each file's tokens into windows of `window` (the last one of a file may be
/// shorter; windows of one token predict nothing and are dropped), keeping at most
/// `max_tokens` scored tokens in all when it is not 0.
fn windows(files: Vec<Vec<u32>>, window: usize, max_tokens: usize) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    let mut scored = 0;
    for tokens in files {
        for w in tokens.chunks(window).filter(|w| w.len() > 1) {
            if max_tokens > 0 && scored + w.len() - 1 > max_tokens {
                let rest = max_tokens - scored;
                if rest > 0 {
                    out.push(w[..rest + 1].to_vec());
                }
                return out;
            }
            scored += w.len() - 1;
            out.push(w.to_vec());
        }
    }
    out
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.window >= 2, "--window must be at least 2 tokens");
    let kind = args.device.backend()?;
    let embedded::Opened {
        ckpt, codec, name, ..
    } = embedded::open(args.model.as_deref())?;
    let mut files = Vec::new();
    for path in &args.files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading {} as UTF-8 text", path.display()))?;
        files.push(codec.encode(&text).map_err(anyhow::Error::msg)?);
    }
    let windows = windows(files, args.window, args.max_tokens);
    anyhow::ensure!(!windows.is_empty(), "the files hold no token to predict");
    let score = with_backend(
        kind,
        Run {
            args: &args,
            ckpt: &ckpt,
            windows,
        },
    )??;
    let loss = score.nll / score.tokens as f64;
    let kv = format!("{:?}", args.device.kv_cache_dtype).to_lowercase();
    let precision = format!("{:?}", args.device.precision).to_lowercase();
    println!(
        "{}: {} tokens in {} files, loss {loss:.4} nats/token, perplexity {:.3} ({kv} cache, {precision} precision, {:.1} tokens/s)",
        name,
        score.tokens,
        args.files.len(),
        loss.exp(),
        score.tokens as f64 / score.seconds,
    );
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "model": name,
            "files": args.files,
            "window": args.window,
            "tokens": score.tokens,
            "loss": loss,
            "perplexity": loss.exp(),
            "kv_cache_dtype": kv,
            "precision": precision,
            "seconds": score.seconds,
        });
        std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_minus_log_softmax() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        for t in 0..3 {
            let want = -((row[t] as f64).exp() / z).ln();
            assert!((nll(&row, t) - want).abs() < 1e-12);
        }
    }

    #[test]
    fn windows_cover_every_token_once_and_respect_the_cap() {
        let files = vec![(0..10).collect::<Vec<u32>>(), vec![7], (0..5).collect()];
        let all = windows(files.clone(), 4, 0);
        assert_eq!(
            all,
            vec![
                vec![0, 1, 2, 3],
                vec![4, 5, 6, 7],
                vec![8, 9],
                vec![0, 1, 2, 3]
            ]
        );
        let scored: usize = all.iter().map(|w| w.len() - 1).sum();
        assert_eq!(scored, 3 + 3 + 1 + 3);
        let capped = windows(files, 4, 5);
        assert_eq!(capped, vec![vec![0, 1, 2, 3], vec![4, 5, 6]]);
    }
}
