//! `kiln`: the command-line entry point, one module per subcommand that runs the engine
//! (`serve`, `generate`, `perplexity`, `check`, `info`). `bench` is `kiln-workload`'s load generator and
//! `route` the `kiln-router` crate, neither of which links the engine.
mod args;
mod check;
mod embedded;
mod generate;
mod info;
mod perplexity;
mod serve;
mod synthetic;

use clap::{Parser, Subcommand};

/// kiln: an inference engine for coding-agent traffic on DeepSeek-V3 / Kimi-K2
/// mixture-of-experts models, with kernels written once in CubeCL for CUDA and wgpu.
///
/// Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) for more. KILN_BACKEND picks the
/// backend (wgpu, cuda or cuda-routed) when --backend is not given; the default is CUDA when compiled in.
#[derive(Parser)]
#[command(name = "kiln", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark a server (kiln, SGLang, vLLM) with coding-agent sessions or a Mooncake
    /// trace: a sweep over concurrency with TTFT, output tokens/s per user, tokens/min per
    /// GPU and cache hit rate, as a table, JSON and a Pareto chart (SVG and PNG).
    Bench(kiln_workload::bench::BenchArgs),
    /// Run every kernel against the reference oracle on realistic shapes and print a table
    /// (kernel, shape, backend, max abs/rel error, tolerance, pass, time). Exits non-zero
    /// if any kernel disagrees with the reference.
    Check(check::CheckArgs),
    /// Generate a completion for a prompt (raw text, greedy by default) with a model
    /// directory or an embedded model (kiln-coder without --model) and print it with prefill
    /// and decode speeds.
    Generate(generate::GenerateArgs),
    /// Serve the model over HTTP: OpenAI-compatible /v1/chat/completions and
    /// /v1/completions (streaming), /v1/responses, Anthropic's /v1/messages, SGLang's /generate (token
    /// ids), /v1/models, /health and
    /// Prometheus /metrics. Without --model it serves kiln-coder, a small coding model kiln
    /// carries in its binary.
    Serve(serve::ServeArgs),
    /// Score text files with a model (kiln-coder without --model): loss and perplexity
    /// through the engine's own kernels, KV cache format and precision, to measure what
    /// NVFP4 experts, an fp8 cache or bf16 tensor cores change.
    Perplexity(perplexity::PerplexityArgs),
    /// Route requests over many kiln (or SGLang) replicas behind one endpoint, keeping each
    /// agent session on the replica that holds its KV cache (`--policy kiln`, the default:
    /// session affinity, load-aware placement of new sessions, thick sessions split,
    /// gentle rebalancing on scale-up, drained unhealthy replicas, one retry before the
    /// first byte; or `session-hash`, `random`). Replicas come from --replica and
    /// --replicas-file (reloaded on SIGHUP or change). The router serves its own /metrics.
    /// With --simulate it runs every policy through a seeded simulation of agent sessions
    /// instead and prints load dispersion, tails, affinity and moves per scale event.
    Route(kiln_router::cli::RouteArgs),
    /// Print the device the chosen backend runs on and what it supports (name, arch,
    /// tensor-core types, bf16 / fp8 / fp4 support).
    Info(info::InfoArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(
                    "info,cubecl_wgpu=warn,wgpu_core=warn,wgpu_hal=warn",
                )
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Bench(args) => Ok(kiln_workload::bench::run(args)?),
        Command::Check(args) => check::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Info(args) => info::run(args),
        Command::Route(args) => Ok(kiln_router::cli::run(args)?),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Serve(args) => serve::run(args),
    }
}
