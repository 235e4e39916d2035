//! `kiln bench`: the coding-agent workload against any OpenAI-compatible server (kiln,
//! SGLang, vLLM), one point per concurrency, with a summary table, JSON and a Pareto chart.
//!
//! The workload (sessions, traces, metrics, chart) is the rest of this crate, without I/O;
//! this module (feature `bench`) is the HTTP side: the client and its SSE framing (`client`, `sse`), the
//! closed-loop session agents (`closed_loop`), trace replay (`replay`), the server's own
//! counters (`prom`) and the progress bar (`progress`). It follows SGLang's
//! `bench_serving` (multi-turn and Mooncake modes) and AIPerf's sweeps.
mod client;
mod closed_loop;
mod progress;
mod prom;
mod replay;
mod sse;

use crate::metrics::{point_label, summarize, PointSummary, RequestRecord};
use crate::plot;
use crate::report::{table, BenchReport, WorkloadSource};
use crate::trace::{read_trace, TraceRequest, TraceTokenizer};
use crate::{SessionGenerator, TokenRange, WorkloadError, WorkloadParams};
use clap::{Args, ValueEnum};
use client::{Api, Client};
use progress::{Counters, Progress};
use prom::TokenCounters;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Session indices of sweep point `i` start at `i << 32`: fresh sessions per point.
const SESSIONS_PER_POINT_SHIFT: u32 = 32;

#[derive(Args)]
#[command(after_long_help = "\
Examples:
  kiln serve --port 30000 &   # or SGLang / vLLM
  kiln bench --url http://127.0.0.1:30000 --scale 0.02 --think-scale 0.05 --duration 30 \\
      --sweep 1,2,4,8 --json sweep.json --plot sweep.svg
  kiln bench --url http://127.0.0.1:30000 --trace mooncake_trace.jsonl --trace-clock
  kiln bench --replot 'TP1 bf16=a1.json,a4.json' --replot 'TP4 fp8=b.json' --plot all.svg

Without --trace, each concurrent user runs generated coding-agent sessions (a shared
system prompt with tool definitions, turns that re-send the whole history plus a tool
result or user message, think times between turns, some sessions fanning out into
concurrent requests), one session after another, for --duration seconds per point.
Full scale (--scale 1) is about 100k input and 500 output tokens per request; sessions
end before they outgrow the model's context (max_model_len from /v1/models).

Per point: TTFT p50/p90/p99; output tokens/s per user after the first token (median, p10);
end-to-end latency; tokens/min per GPU (prompt + output, and output alone, over the
point's wall time divided by --gpus); cache hit rate (cached_tokens / prompt_tokens as
the responses report them, and from the server's own /metrics counters when it exports
kiln's or SGLang's); speculative accept length (SGLang's spec_verify_ct); errors.")]
pub struct BenchArgs {
    /// Base URL of the server, e.g. http://127.0.0.1:30000.
    #[arg(long, required_unless_present = "replot")]
    url: Option<String>,
    /// Run nothing: draw --plot from reports saved with --json, one series per
    /// LABEL=FILE[,FILE...] (the points of its files together, in a colour of its own,
    /// named in the legend); repeat for several configurations on one chart.
    #[arg(long, value_name = "LABEL=FILES", requires = "plot")]
    replot: Vec<String>,
    /// Concurrencies to run, one point each (concurrent sessions, or replay workers).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    sweep: Vec<u32>,
    /// Seconds per point: no new turn starts after it; requests in flight finish.
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Write every point (and the workload's parameters) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw the Pareto chart (x = output tokens/s per user, y = tokens/min per GPU, each
    /// point labelled with its concurrency) to this file; an .svg and a .png are written.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// GPUs the server runs on (throughput is reported per GPU).
    #[arg(long, default_value_t = 1)]
    gpus: u32,
    /// Shrinks every context by this factor (system prompt, messages, outputs, context
    /// limit, trace blocks), so the same shape runs against a small model; 1 = full scale.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Multiplies think times (tool latencies, user gaps); 0 sends turns back to back.
    #[arg(long, default_value_t = 1.0)]
    think_scale: f64,
    /// Replay a Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids of
    /// 512-token blocks) instead of generated sessions.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// With --trace: send each request at its timestamp (one point; --sweep is ignored)
    /// instead of closed-loop.
    #[arg(long, requires = "trace")]
    trace_clock: bool,
    /// With --trace-clock: replay this many times faster than recorded.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// How to send prompts: token ids to /generate, text to /v1/completions, or auto
    /// (/generate when the server answers it).
    #[arg(long, value_enum, default_value_t = ApiChoice::Auto)]
    api: ApiChoice,
    /// Model name for OpenAI requests (default: the first one /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Workload seed: the same seed sends the same token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// At most this many sessions per point (default: as many as the duration allows).
    #[arg(long)]
    sessions: Option<u64>,
    /// Largest token id to send (ids are drawn from 3 up to it); keep it inside the
    /// server's vocabulary.
    #[arg(long, default_value_t = 258)]
    max_token_id: u32,
    /// Sampling temperature (outputs are always exactly their length: ignore_eos).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Per-request timeout in seconds (a timed-out request counts as an error).
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

/// Why a benchmark could not run (a failed request is not an error: it is counted).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag is out of its domain.
    #[error("{0}")]
    Args(String),
    /// The async runtime did not start.
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The HTTP client could not be built.
    #[error(transparent)]
    Client(#[from] reqwest::Error),
    /// The server did not answer `/v1/models`.
    #[error("server not reachable: {0}")]
    Unreachable(String),
    /// The trace file could not be read.
    #[error("reading the trace")]
    Trace(#[source] WorkloadError),
    /// The workload's contexts do not fit the server's.
    #[error("the workload does not fit the server's context of {context:?} tokens: lower --scale")]
    Fit {
        context: Option<u32>,
        #[source]
        source: WorkloadError,
    },
    /// Writing the JSON or the chart failed.
    #[error(transparent)]
    Output(#[from] WorkloadError),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ApiChoice {
    Auto,
    Generate,
    Text,
}

/// Runs the sweep `args` describe: prints each point as it ends and the summary table,
/// writes the JSON and the chart when asked.
pub fn run(args: BenchArgs) -> Result<(), BenchError> {
    if !args.replot.is_empty() {
        return replot(&args);
    }
    check(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    let report = runtime.block_on(sweep(&args))?;
    println!("{}", table(&report.points));
    if let Some(path) = &args.json {
        report.write_json(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        let title = format!(
            "kiln bench: {} ({} GPU, scale {})",
            report.model, args.gpus, args.scale
        );
        for f in plot::write_pareto(&report.points, &title, path)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}

/// Draws the chart of `--replot`'s saved reports into `--plot`.
fn replot(args: &BenchArgs) -> Result<(), BenchError> {
    let mut series = Vec::new();
    for spec in &args.replot {
        let (label, files) = spec.split_once('=').ok_or_else(|| {
            BenchError::Args(format!("--replot takes LABEL=FILE[,FILE...], got {spec:?}"))
        })?;
        let mut points = Vec::new();
        for file in files.split(',').filter(|f| !f.is_empty()) {
            points.extend(BenchReport::read_json(std::path::Path::new(file))?.points);
        }
        if points.is_empty() {
            return Err(BenchError::Args(format!(
                "--replot {spec:?} names no report"
            )));
        }
        series.push(plot::Series {
            label: label.to_string(),
            points,
        });
    }
    let path = args
        .plot
        .as_ref()
        .expect("clap requires --plot with --replot");
    let title = format!("kiln bench ({} GPU per point)", args.gpus);
    for f in plot::write_pareto_series(&series, &title, path)? {
        eprintln!("wrote {}", f.display());
    }
    Ok(())
}

fn check(args: &BenchArgs) -> Result<(), BenchError> {
    let problem = if args.sweep.is_empty() || args.sweep.contains(&0) {
        format!(
            "--sweep needs concurrencies of at least 1, got {:?}",
            args.sweep
        )
    } else if !(args.duration > 0.0 && args.timeout > 0.0 && args.speedup > 0.0) {
        "--duration, --timeout and --speedup must be positive".into()
    } else if !(args.scale > 0.0 && args.scale <= 1.0) {
        format!("--scale must be in (0, 1], got {}", args.scale)
    } else if args.think_scale.is_nan()
        || args.think_scale < 0.0
        || args.gpus == 0
        || args.max_token_id < 3
    {
        "--think-scale must be >= 0, --gpus >= 1 and --max-token-id >= 3".into()
    } else {
        return Ok(());
    };
    Err(BenchError::Args(problem))
}

async fn sweep(args: &BenchArgs) -> Result<BenchReport, BenchError> {
    let (client, context) = connect(args).await?;
    let range = TokenRange {
        first: 3,
        end: args.max_token_id + 1,
    };
    let mut params = WorkloadParams {
        token_range: range,
        ..WorkloadParams::default()
    }
    .scaled(args.scale)
    .think_scaled(args.think_scale);
    // Sessions end before they outgrow the model (prompt plus output within its context).
    if let Some(len) = context {
        params.max_context = params.max_context.min(len);
    }
    let trace = match &args.trace {
        Some(path) => Some(read_trace(path).map_err(BenchError::Trace)?),
        None => None,
    };
    let generator = SessionGenerator::new(params.clone(), args.seed)
        .map_err(|source| BenchError::Fit { context, source })?;
    let concurrencies = if args.trace_clock {
        vec![0]
    } else {
        args.sweep.clone()
    };
    let mut points = Vec::new();
    for (i, &c) in concurrencies.iter().enumerate() {
        let before = server_counters(&client).await;
        let counters = Arc::new(Counters::default());
        let progress =
            Progress::start(point_label(c), duration(args), counters.clone(), args.quiet);
        let (records, elapsed) = match &trace {
            Some(trace) => replay_point(args, &client, trace, i as u64, c, counters).await,
            None => sessions_point(args, &client, &generator, i as u64, c, counters).await,
        };
        progress.finish();
        let mut point = summarize(c, args.gpus, elapsed, &records);
        if let (Some(b), Some(a)) = (before, server_counters(&client).await) {
            point.server_cache_hit_rate = a.hit_rate_since(&b);
            point.server_host_hit_rate = a.host_hit_rate_since(&b);
        }
        eprintln!("{}", one_line(&point));
        for e in &point.error_samples {
            eprintln!("  error: {e}");
        }
        points.push(point);
    }
    let workload = match (&args.trace, &trace) {
        (Some(path), Some(t)) => WorkloadSource::Trace {
            path: path.display().to_string(),
            requests: t.len(),
            timed: args.trace_clock,
        },
        _ => WorkloadSource::Sessions { params },
    };
    Ok(BenchReport {
        url: url(args).to_string(),
        model: client.model.clone(),
        api: client.api.name().to_string(),
        seed: args.seed,
        scale: args.scale,
        duration_s: args.duration,
        workload,
        points,
    })
}

/// `--url` (clap makes it present whenever there is a sweep to run).
fn url(args: &BenchArgs) -> &str {
    args.url.as_deref().unwrap_or_default()
}

fn duration(args: &BenchArgs) -> Duration {
    Duration::from_secs_f64(args.duration)
}

/// A client with the model and API resolved against the server, and the model's context
/// length when the server lists it.
async fn connect(args: &BenchArgs) -> Result<(Client, Option<u32>), BenchError> {
    let timeout = Duration::from_secs_f64(args.timeout);
    let probe = Client::new(
        url(args),
        Api::Generate,
        String::new(),
        args.temperature,
        timeout,
    )?;
    let listed = probe.first_model().await.map_err(BenchError::Unreachable)?;
    let context = listed.as_ref().and_then(|m| m.max_model_len);
    let model = args
        .model
        .clone()
        .or(listed.map(|m| m.id))
        .unwrap_or_else(|| "default".into());
    let api = match args.api {
        ApiChoice::Generate => Api::Generate,
        ApiChoice::Text => Api::Text,
        ApiChoice::Auto if probe.has_generate(3).await => Api::Generate,
        ApiChoice::Auto => Api::Text,
    };
    eprintln!(
        "kiln bench: {} model {model}, api {}",
        url(args),
        api.name()
    );
    Ok((
        Client::new(url(args), api, model, args.temperature, timeout)?,
        context,
    ))
}

async fn server_counters(client: &Client) -> Option<TokenCounters> {
    TokenCounters::parse(&client.metrics().await?)
}

async fn sessions_point(
    args: &BenchArgs,
    client: &Client,
    generator: &SessionGenerator,
    point: u64,
    concurrency: u32,
    counters: Arc<Counters>,
) -> (Vec<RequestRecord>, f64) {
    let shared = closed_loop::Shared::new(
        client.clone(),
        generator.clone(),
        point << SESSIONS_PER_POINT_SHIFT,
        args.sessions.unwrap_or(u64::MAX),
        duration(args),
        counters,
    );
    closed_loop::run(Arc::new(shared), concurrency).await
}

async fn replay_point(
    args: &BenchArgs,
    client: &Client,
    trace: &[TraceRequest],
    point: u64,
    concurrency: u32,
    counters: Arc<Counters>,
) -> (Vec<RequestRecord>, f64) {
    let range = TokenRange {
        first: 3,
        end: args.max_token_id + 1,
    };
    let replay = Arc::new(replay::Replay {
        client: client.clone(),
        trace: trace.to_vec(),
        tokenizer: TraceTokenizer::new(args.scale, args.seed.wrapping_add(point), range),
        counters,
    });
    if args.trace_clock {
        replay::timed(replay, args.speedup, duration(args)).await
    } else {
        replay::closed_loop(replay, concurrency, duration(args)).await
    }
}

/// A point in one line, printed as the sweep goes.
fn one_line(p: &PointSummary) -> String {
    let ttft = p.ttft_s.map_or(f64::NAN, |d| d.p50);
    let tps = p.output_tps_per_user.map_or(f64::NAN, |d| d.p50);
    format!(
        "{}: {} requests ({} errors), TTFT p50 {ttft:.3}s, {tps:.1} tok/s/user, {:.0} tok/min/GPU, CHR {}",
        p.label(),
        p.requests,
        p.errors,
        p.tokens_per_min_per_gpu,
        p.cache_hit_rate.map_or("-".into(), |c| format!("{:.1}%", c * 100.0)),
    )
}
