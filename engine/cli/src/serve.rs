//! `kiln serve`: the OpenAI-compatible server over one engine.
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::args::{DeviceArgs, PrefixCacheArg};
use crate::embedded;
use crate::synthetic::SyntheticArgs;
use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Args;
use kiln::engine::{self, EngineConfig, ModelSource};
use kiln::model::default_model;
use kiln::server::{router, AppState, ChatTemplate, KimiFormat, KIMI_TEMPLATE};
use kiln::speculative::{DraftPolicy, DrafterKind, SpecConfig, MAX_DRAFT_NODES};
use kiln_kernels::mla::PER_HEAD_MIN_Q_LEN;

#[derive(Args)]
pub struct ServeArgs {
    /// HF model directory (config.json, model*.safetensors, tokenizer.json), or the name of
    /// a model kiln carries: kiln-coder (the default: a small model trained on Python and
    /// Kimi-format chat turns, NVFP4 experts, 8k context) or kiln-tiny-random (random
    /// weights, loads in milliseconds: for tests). The context length (the config's
    /// max_position_embeddings) is logged at start-up and listed as max_model_len in
    /// /v1/models; a prompt plus max_tokens beyond it is refused with 400.
    #[arg(long, value_name = "DIR|NAME")]
    model: Option<PathBuf>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0 picks a free one; the address is printed on stdout).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on the API endpoints (/health and /metrics stay
    /// open). Also read from KILN_API_KEY; an empty key is refused.
    #[arg(long, env = "KILN_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// Tokens per KV page (the prefix cache shares whole pages).
    #[arg(long, default_value_t = 64)]
    page_size: usize,
    /// KV pages in the pool (default: free device memory less --memory-reserve-gib on CUDA;
    /// 64k tokens on wgpu).
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Device memory left free when sizing the KV pool, in GiB.
    #[arg(long, default_value_t = 4.0)]
    memory_reserve_gib: f64,
    /// Token budget of one step: decode tokens plus prefill chunks (chunked prefill).
    #[arg(long, default_value_t = 2048)]
    max_batch_tokens: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    max_running_requests: usize,
    /// Most requests waiting; beyond it new requests get 503.
    #[arg(long, default_value_t = 4096)]
    max_queued_requests: usize,
    /// Prefix cache: radix (default) or flat (the naive oracle; slow on large caches, and
    /// without a host tier).
    #[arg(long, value_enum, default_value_t = PrefixCacheArg::Radix)]
    prefix_cache: PrefixCacheArg,
    /// Host RAM for the prefix cache's second tier, in GiB: pages evicted from the device
    /// pool are copied there, and a later request that reaches them copies them back
    /// instead of recomputing them (0: off). Default: a quarter of the machine's RAM. Used
    /// as pages are evicted, not reserved at start.
    #[arg(long, value_name = "GIB")]
    host_kv_gib: Option<f64>,
    /// Model name in the API (default: the directory's or the embedded model's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// On SIGTERM or SIGINT: seconds to let requests in flight finish (/health and new
    /// requests get 503 meanwhile); streams still running then end with an error event.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    shutdown_timeout: f64,
    /// Seconds a request may wait on a client that reads none of its output (its tokens
    /// wait in a bounded buffer, the request paused) before it is aborted.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    client_stall_timeout: f64,
    /// Speculative decoding: off, or ngram (prompt lookup: drafts copied from where the
    /// request's last tokens occurred before, verified in the next step; the output is
    /// the same as without, greedy or sampled), suffix (token trees of the likeliest
    /// continuations of the longest contexts matching the request's last tokens, in its
    /// own tokens and in all requests' recent outputs, verified as trees; as lossless), or
    /// simulate (a benchmark mode: see --simulated-accept-len). Off above 16 decoding
    /// requests.
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Off)]
    speculative: SpeculativeArg,
    /// Most tokens a request drafts per step (a tree's nodes; at most 31).
    #[arg(long, default_value_t = 4, value_name = "N")]
    max_draft_tokens: usize,
    /// How many tokens each request drafts within --max-draft-tokens: measured (from the
    /// decode steps' measured times by size and each request's recent acceptance, drafting
    /// only where the expected tokens per second beat a plain step by 5%: off where
    /// verification costs more than it earns), or fixed (always the most).
    #[arg(long, value_enum, default_value_t = DraftPolicyArg::Measured)]
    draft_policy: DraftPolicyArg,
    /// Benchmarks only (as SGLang's SGLANG_SIMULATE_ACC_LEN): decoding requests draft (all
    /// --max-draft-tokens with --draft-policy fixed; what the policy gives otherwise) and
    /// each verify step keeps enough drafted tokens at random to emit LEN tokens on
    /// average, or all of a shorter draft, whatever the model says. Outputs are not the
    /// model's; measures what speculation at that acceptance would give. Needs
    /// --speculative simulate.
    #[arg(long, value_name = "LEN")]
    simulated_accept_len: Option<f64>,
    /// Plan and issue each step only after the step before has been read back (SGLang's
    /// flag of this name). By default a step whose tokens are all drawn on the device
    /// stays in flight while the next is planned and issued, which reads its tokens on the
    /// device; a step whose rows the host reads (a JSON schema's masks, drafts to verify)
    /// is waited for either way. Outputs are the same.
    #[arg(long)]
    disable_overlap_schedule: bool,
    /// Requests prefilling at least N new tokens in a step attend in MLA's per-head form
    /// (context expanded by kv_b_proj, 192/128-wide heads: fewer products than the
    /// absorbed form for long spans), the rest absorbed; 0: always absorbed. On tensor
    /// cores (CUDA at bf16) both forms run there; a model whose head dims the per-head
    /// tensor-core kernel does not take stays absorbed.
    #[arg(long, default_value_t = PER_HEAD_MIN_Q_LEN, value_name = "N")]
    mla_per_head_from: usize,
    /// Record decode steps as CUDA graphs at these batch sizes and replay them, a batch
    /// padded to the smallest size that holds it (larger batches, prefill chunks and draft
    /// verification run eagerly); e.g. 1,2,4,8,16,32. Needs --backend cuda-routed. Each
    /// graph holds the device memory its step allocates. Default: off.
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    cuda_graph_sizes: Vec<usize>,
}

/// `--speculative`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum SpeculativeArg {
    Off,
    Ngram,
    /// Frequency-scored continuations of the longest matching context, from the request's
    /// tokens and all requests' recent outputs.
    Suffix,
    /// Simulated acceptance (--simulated-accept-len): a benchmark mode.
    Simulate,
}

/// `--draft-policy`.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum DraftPolicyArg {
    Measured,
    Fixed,
}

/// `--host-kv-gib` in bytes; without it a quarter of the machine's RAM (none where the
/// RAM is unknown).
fn host_kv_bytes(gib: Option<f64>) -> anyhow::Result<u64> {
    match gib {
        Some(g) => {
            anyhow::ensure!(g >= 0.0 && g.is_finite(), "--host-kv-gib must be 0 or more");
            Ok((g * (1u64 << 30) as f64) as u64)
        }
        None => Ok(total_ram_bytes().unwrap_or(0) / 4),
    }
}

/// `MemTotal` of /proc/meminfo.
fn total_ram_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `--speculative` and its flags, checked.
fn speculative(args: &ServeArgs) -> anyhow::Result<Option<SpecConfig>> {
    let accept = args.simulated_accept_len;
    let simulate = matches!(args.speculative, SpeculativeArg::Simulate);
    anyhow::ensure!(
        simulate == accept.is_some(),
        "--speculative simulate and --simulated-accept-len go together"
    );
    if let Some(len) = accept {
        anyhow::ensure!(
            len >= 1.0 && len <= (args.max_draft_tokens + 1) as f64,
            "--simulated-accept-len must be 1 to --max-draft-tokens + 1 ({}), got {len}",
            args.max_draft_tokens + 1
        );
    }
    let drafter = match args.speculative {
        SpeculativeArg::Off => return Ok(None),
        SpeculativeArg::Ngram => DrafterKind::Ngram,
        SpeculativeArg::Suffix => DrafterKind::Suffix,
        SpeculativeArg::Simulate => DrafterKind::Simulated,
    };
    anyhow::ensure!(
        (1..=MAX_DRAFT_NODES).contains(&args.max_draft_tokens),
        "--max-draft-tokens must be 1 to {MAX_DRAFT_NODES} (a draft tree and its root fill \
         the attention kernels' 32-query mask), got {}",
        args.max_draft_tokens
    );
    Ok(Some(SpecConfig {
        drafter,
        max_draft: args.max_draft_tokens,
        policy: match args.draft_policy {
            DraftPolicyArg::Measured => DraftPolicy::Measured,
            DraftPolicyArg::Fixed => DraftPolicy::Fixed,
        },
        simulated_accept_len: accept,
    }))
}

/// A duration flag: finite and not negative.
fn seconds(flag: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds >= 0, got {s}"))
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C), naming which.
async fn shutdown_signal() -> &'static str {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
        "SIGINT"
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                name = ctrl_c => name,
                _ = term.recv() => "SIGTERM",
            },
            Err(_) => ctrl_c.await,
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.page_size > 0, "--page-size must be at least 1");
    anyhow::ensure!(
        args.api_key.as_ref().is_none_or(|k| !k.is_empty()),
        "--api-key (or KILN_API_KEY) is empty: give a key, or unset it to serve without one"
    );
    let shutdown_timeout = seconds("--shutdown-timeout", args.shutdown_timeout)?;
    let stall_timeout = seconds("--client-stall-timeout", args.client_stall_timeout)?;
    anyhow::ensure!(
        args.max_batch_tokens >= args.max_running_requests && args.max_running_requests > 0,
        "--max-batch-tokens must be at least --max-running-requests (each runs one token a step)"
    );
    let kind = args.device.backend()?;
    let (source, codec, name) = match args.synthetic.spec()? {
        Some(spec) => {
            let c = &spec.config;
            tracing::info!(
                layers = c.num_hidden_layers,
                heads = c.num_attention_heads,
                experts = c.n_routed_experts,
                vocab = c.vocab_size,
                tp_rank_of = ?spec.tp_ranks,
                quant = ?spec.quant,
                "serving a synthetic model (weights generated on the device; outputs mean nothing)"
            );
            let name = args.synthetic.name();
            (ModelSource::Synthetic(spec), default_model::codec(), name)
        }
        None => {
            let m = embedded::open(args.model.as_deref())?;
            if m.embedded {
                tracing::info!(model = %m.name, "serving an embedded model");
            }
            (ModelSource::Checkpoint(m.ckpt), m.codec, m.name)
        }
    };
    let cfg = EngineConfig {
        backend: kind,
        kv_format: args.device.kv_cache_dtype.into(),
        precision: args.device.precision.into(),
        page_size: args.page_size,
        kv_pages: args.kv_pages,
        memory_reserve: (args.memory_reserve_gib * (1u64 << 30) as f64) as u64,
        max_batch_tokens: args.max_batch_tokens,
        max_running: args.max_running_requests,
        cache: args.prefix_cache.into(),
        host_kv_bytes: host_kv_bytes(args.host_kv_gib)?,
        stall_timeout,
        speculative: speculative(&args)?,
        overlap: !args.disable_overlap_schedule,
        per_head_from: (args.mla_per_head_from > 0).then_some(args.mla_per_head_from),
        graph_sizes: (!args.cuda_graph_sizes.is_empty()).then(|| args.cuda_graph_sizes.clone()),
    };
    let engine = engine::start(cfg, source)?;
    let chat = KimiFormat::new(&codec).ok();
    let template = match (&codec.chat_template, &chat) {
        (Some(source), _) => ChatTemplate::new(source, &codec)
            .inspect_err(|e| tracing::warn!("chat endpoints unavailable: {e}"))
            .ok(),
        (None, Some(_)) => {
            Some(ChatTemplate::new(KIMI_TEMPLATE, &codec).expect("kiln's own template"))
        }
        (None, None) => {
            tracing::warn!("chat endpoints unavailable: the tokenizer has no chat template");
            None
        }
    };
    if chat.is_none() {
        tracing::warn!("tool calls unavailable: the tokenizer lacks Kimi's tool-call tokens");
    }
    let state = Arc::new(AppState::new(
        engine,
        Arc::new(codec),
        template,
        chat,
        args.served_model_name.clone().unwrap_or(name),
        args.api_key.clone(),
        args.max_running_requests + args.max_queued_requests,
    ));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound = listener.local_addr()?;
        // Tokens go out as small writes: without TCP_NODELAY, Nagle's algorithm and the
        // client's delayed ACK hold them back ~40 ms.
        let listener = listener.tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("TCP_NODELAY not set: {e}");
            }
        });
        let info = &state.engine.info;
        tracing::info!(
            model = %state.model_name,
            device = %info.device,
            context_len = info.context_len,
            kv_tokens = info.kv_pages * info.page_size,
            "serving"
        );
        println!("kiln serve listening on http://{bound}");
        std::io::stdout().flush()?;
        let drained = state.clone();
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                let signal = shutdown_signal().await;
                tracing::info!(signal, "shutting down");
                drained.drain(shutdown_timeout).await;
            })
            .await?;
        tracing::info!("stopped");
        Ok(())
    })
}
