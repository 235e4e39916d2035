//! The engine thread: owns the model on the device, the KV pool and the scheduler, and
//! runs steps while there is work. Requests come in over a channel; each request's events
//! (tokens, then the end) go back over its own channel, so the server never blocks on the
//! device and the device never waits on a client. A client that drops its receiver is
//! aborted before the next step and its pages are freed.
//!
//! The loop is "schedule, issue the step, complete the step before" (see `run` for the
//! overlapped schedule). Room for tensor parallelism: with N
//! shards the step becomes N shard steps issued in lockstep on the same `Batch` (one
//! thread per GPU, all-reduce inside the forward pass), and only rank 0's logits are read.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cubecl::prelude::*;
use kiln_backends::{with_backend, BackendError, BackendKind, BackendVisitor, DeviceReport};
use kiln_kernels::mla::{KvFormat, MAX_DECODE_Q_LEN};
use kiln_kernels::Precision;

use crate::cache::CacheKind;
use crate::metrics::{Metrics, StepKind};
use crate::model::gpu::{
    Batch, GpuModel, HostKv, KvPool, Launched, ModelError, RequestSlice, SyntheticQuant,
};
use crate::model::Checkpoint;
use crate::scheduler::{policy, Logprobs, Scheduler, SchedulerConfig, Scores, Step, Submission};
use crate::speculative::SpecConfig;
use kiln_core::model::ModelConfig;
use kiln_core::sampling::SamplingRow;

/// The weights the engine serves.
pub enum ModelSource {
    /// A checkpoint's, loaded onto the device.
    Checkpoint(Checkpoint),
    /// Weights generated on the device for an architecture: the real shapes and formats,
    /// outputs that mean nothing (benchmarks of serving at full width).
    Synthetic(SyntheticSpec),
}

/// A synthetic model: its architecture and how its weights are stored.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub config: ModelConfig,
    pub quant: SyntheticQuant,
    /// The context length it serves (the real model's `max_position_embeddings`).
    pub context_len: usize,
    pub seed: u32,
    /// `Some(T)`: `config` is one rank's share of TP over `T` GPUs, whose all-reduces are
    /// stood in by device work of their modelled time (`model::tp::AllReduceStandIn`).
    pub tp_ranks: Option<usize>,
}

impl ModelSource {
    fn load<R: Runtime>(
        &self,
        client: ComputeClient<R>,
        precision: Precision,
    ) -> Result<GpuModel<R>, ModelError> {
        match self {
            ModelSource::Checkpoint(ckpt) => GpuModel::load_with(client, ckpt, precision),
            ModelSource::Synthetic(s) => {
                let model =
                    GpuModel::synthetic_with(client, s.config.clone(), s.seed, s.quant, precision)?;
                match s.tp_ranks {
                    Some(ranks) => model.with_all_reduce_stand_in(ranks),
                    None => Ok(model),
                }
            }
        }
    }

    /// The longest context and the end-of-sequence ids (none for a synthetic model).
    fn limits(&self) -> (usize, Vec<u32>) {
        match self {
            ModelSource::Checkpoint(c) => (c.spec.context_len, c.spec.eos_token_ids.clone()),
            ModelSource::Synthetic(s) => (s.context_len, Vec::new()),
        }
    }
}

/// How to run the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub backend: BackendKind,
    pub kv_format: KvFormat,
    /// What the kernels may round (`Precision::Bf16`: tensor cores where available).
    pub precision: Precision,
    /// Tokens per KV page (64, the MLA kernels' tile, unless testing).
    pub page_size: usize,
    /// KV pages; `None` sizes the pool from the device's free memory.
    pub kv_pages: Option<usize>,
    /// Device memory (bytes) left free when sizing the pool.
    pub memory_reserve: u64,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub cache: CacheKind,
    /// Host RAM for the prefix cache's host tier, in bytes (0: no tier; the flat cache has
    /// none).
    pub host_kv_bytes: u64,
    /// How long a request may wait on a client that reads none of its output before it is
    /// aborted (its output is held in a bounded buffer meanwhile).
    pub stall_timeout: Duration,
    /// Speculative decoding (`None`: off).
    pub speculative: Option<SpecConfig>,
    /// Plan and issue each step while the device runs the one before, where the step
    /// before draws all its tokens on the device (see `run`).
    pub overlap: bool,
    /// Requests prefilling this many new tokens or more attend in MLA's per-head form
    /// (`GpuModel::set_per_head_from`; `None`: all absorbed).
    pub per_head_from: Option<usize>,
    /// Batch sizes decode steps are recorded at as CUDA graphs and replayed
    /// (`GpuModel::enable_graphs`; the `cuda-routed` backend); `None`: issued eagerly.
    pub graph_sizes: Option<Vec<usize>>,
}

/// What the server needs to know about the running model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    pub vocab_size: usize,
    pub context_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub page_size: usize,
    pub kv_pages: usize,
    pub device: String,
}

impl ModelInfo {
    /// Why `prompt` with `max_tokens` more cannot run, if it cannot.
    pub fn check(&self, prompt: &[u32], max_tokens: usize) -> Result<(), String> {
        if prompt.is_empty() {
            return Err("the prompt is empty".into());
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(format!(
                "token id {t} is outside the vocabulary (0..{})",
                self.vocab_size
            ));
        }
        let total = prompt.len() + max_tokens;
        if total > self.context_len {
            return Err(format!(
                "this model's maximum context length is {} tokens; the prompt has {} and \
                 max_tokens asks for {max_tokens} more ({total})",
                self.context_len,
                prompt.len()
            ));
        }
        if !policy::fits_pool(prompt.len(), max_tokens, self.page_size, self.kv_pages) {
            return Err(format!(
                "the KV cache holds {} tokens; the prompt has {} and max_tokens asks for \
                 {max_tokens} more",
                self.kv_pages * self.page_size,
                prompt.len()
            ));
        }
        Ok(())
    }
}

/// The server's side of a running engine.
pub struct EngineHandle {
    submit: Sender<Submission>,
    pub info: ModelInfo,
    pub metrics: Arc<Metrics>,
    next_id: AtomicU64,
    thread: std::thread::JoinHandle<()>,
}

impl EngineHandle {
    /// Whether the engine thread still runs (it ends on a panic, e.g. a device failure).
    pub fn is_alive(&self) -> bool {
        !self.thread.is_finished()
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Hands a request to the engine thread; `Err` if the engine has stopped.
    pub fn submit(&self, s: Submission) -> Result<(), String> {
        self.submit
            .send(s)
            .map_err(|_| "the engine has stopped".to_string())
    }
}

/// Why the engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("starting the engine thread: {0}")]
    Spawn(#[from] std::io::Error),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Load(ModelError),
    #[error("warm-up step: {0}")]
    WarmUp(ModelError),
    #[error("the engine thread exited while loading")]
    Exited,
}

/// Starts the engine thread for `source`; returns once the model is on the device.
pub fn start(cfg: EngineConfig, source: ModelSource) -> Result<EngineHandle, StartError> {
    let (submit, requests) = mpsc::channel();
    let (ready_tx, ready) = mpsc::channel();
    let metrics = Arc::new(Metrics::default());
    let m = metrics.clone();
    let thread = std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let kind = cfg.backend;
            let runner = Runner {
                cfg,
                source,
                requests,
                ready: ready_tx.clone(),
                metrics: m,
            };
            if let Err(e) = with_backend(kind, runner) {
                let _ = ready_tx.send(Err(e.into()));
            }
        })?;
    let info = ready.recv().map_err(|_| StartError::Exited)??;
    Ok(EngineHandle {
        submit,
        info,
        metrics,
        next_id: AtomicU64::new(0),
        thread,
    })
}

struct Runner {
    cfg: EngineConfig,
    source: ModelSource,
    requests: Receiver<Submission>,
    ready: Sender<Result<ModelInfo, StartError>>,
    metrics: Arc<Metrics>,
}

impl BackendVisitor for Runner {
    type Output = ();

    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) {
        let fail = |e: StartError| {
            let _ = self.ready.send(Err(e));
        };
        tracing::info!(device = %report.name, backend = ?report.backend, "loading the model");
        let mut model = match self.source.load(client, self.cfg.precision) {
            Ok(m) => m,
            Err(e) => return fail(StartError::Load(e)),
        };
        model.set_per_head_from(self.cfg.per_head_from);
        if let Some(sizes) = &self.cfg.graph_sizes {
            if let Err(e) = model.enable_graphs(sizes.clone()) {
                return fail(StartError::Load(e));
            }
        }
        let page = self.cfg.page_size;
        let row_bytes = (self.cfg.kv_format.words_per_row() * 4) as u64;
        let layers = model.config.num_hidden_layers as u64;
        let pages = match self.cfg.kv_pages {
            Some(p) => p,
            None => {
                let free = kiln_backends::free_memory(report.backend);
                kv_pages_for(free, self.cfg.memory_reserve, row_bytes, layers, page)
            }
        };
        let pool = model.kv_pool(pages, page, self.cfg.kv_format);
        let (context_len, eos_token_ids) = self.source.limits();
        let info = ModelInfo {
            vocab_size: model.config.vocab_size,
            context_len,
            eos_token_ids,
            page_size: page,
            kv_pages: pages,
            device: report.name.clone(),
        };
        tracing::info!(
            pages,
            page_size = page,
            tokens = pages * page,
            format = ?self.cfg.kv_format,
            "KV pool ready"
        );
        let sched_cfg = SchedulerConfig {
            page_size: page,
            max_batch_tokens: self.cfg.max_batch_tokens,
            max_running: self.cfg.max_running,
            context_len: info.context_len,
            eos_token_ids: info.eos_token_ids.clone(),
            stall_timeout: self.cfg.stall_timeout,
            speculative: self.cfg.speculative,
        };
        // The flat oracle has no host tier.
        let host_slots = match self.cfg.cache {
            CacheKind::Radix => self.cfg.host_kv_bytes / HostKv::slot_bytes(&pool).max(1) as u64,
            CacheKind::Flat => 0,
        } as usize;
        let mut host = HostKv::new(&pool, host_slots);
        tracing::info!(
            pages = host_slots,
            gib = self.cfg.host_kv_bytes as f64 / (1u64 << 30) as f64,
            "host KV tier"
        );
        self.metrics.kv_host_total_pages.set(host_slots as f64);
        let cache = self.cfg.cache.build(page, host_slots);
        let mut sched = Scheduler::new(sched_cfg, pages, cache, self.metrics.clone());
        let vocab = info.vocab_size;
        if let Err(e) = warm_up(&model, &pool, page, pages) {
            return fail(StartError::WarmUp(e));
        }
        if self.ready.send(Ok(info)).is_err() {
            return;
        }
        run(
            &model,
            &pool,
            &mut host,
            &mut sched,
            &self.requests,
            vocab,
            &self.metrics,
            self.cfg.overlap,
        );
    }
}

/// Runs a prefill, a decode step, a draft tree and sampled steps (masked, fed from the step
/// before, with log-probabilities) of one request on the pool's first pages before the
/// server opens, so the first client does not wait while their kernels compile (0.4 s on
/// llvmpipe, 14 s on the H200 for the embedded model); then, where prefills attend per
/// head on tensor cores and the pool holds one, a prefill long enough to (its kernels, and
/// the GEMMs' paths at its row count: seconds of NVRTC on CUDA; on llvmpipe the prefill
/// would cost more than the compile it saves, 9 s against 2 for the embedded model). Shapes
/// that pick other kernel variants (other GEMM paths by row count, a context expanded in
/// several chunks) still compile on first use, seconds each on CUDA.
/// The pages stay free in the scheduler: no request reads a KV row it has not written
/// itself.
fn warm_up<R: Runtime>(
    model: &GpuModel<R>,
    pool: &KvPool,
    page: usize,
    pages: usize,
) -> Result<(), ModelError> {
    let start = Instant::now();
    // Past the decode kernel's query length where the pool allows, so prefill runs too.
    let prompt = (MAX_DECODE_Q_LEN + 1).min((pages * page).saturating_sub(1));
    if prompt == 0 {
        return Ok(());
    }
    let vocab = model.config.vocab_size as u32;
    let slice = |tokens: Vec<u32>, kv_len: usize, tree| RequestSlice {
        tokens,
        kv_len,
        block_table: (0..kv_len.div_ceil(page) as u32).collect(),
        tree,
    };
    let prefill = |len: usize| {
        let tokens = (0..len as u32).map(|t| t % vocab).collect();
        model.step(&Batch::last_logits(vec![slice(tokens, len, None)]), pool)
    };
    prefill(prompt)?;
    model.step(
        &Batch::last_logits(vec![slice(vec![0], prompt + 1, None)]),
        pool,
    )?;
    // A draft tree's attention (speculative decoding) compiles its own kernels.
    let tree = slice(vec![0, 0], prompt + 1, Some(vec![-1, 0]));
    model.step(&Batch::last_logits(vec![tree]), pool)?;
    // Sampling on the device as served: a row under a grammar's mask, then a step that
    // takes its input id from that one's draw (the overlapped schedule), with
    // log-probabilities.
    let sampled = |masks, from_previous, logprobs| Batch {
        sampling: Some(vec![SamplingRow::greedy()]),
        masks,
        from_previous,
        logprobs,
        ..Batch::last_logits(vec![slice(vec![0], prompt + 1, None)])
    };
    let all_allowed = vec![(0, vec![u32::MAX; (vocab as usize).div_ceil(32)])];
    let first = model.launch(&sampled(all_allowed, Vec::new(), None), pool, None)?;
    let fed = sampled(Vec::new(), vec![(0, 0)], Some(1));
    let second = model.launch(&fed, pool, first.sampled())?;
    first.wait()?;
    second.wait()?;
    if let Some(len) = model.per_head_from().filter(|&from| {
        from > prompt && from < pages * page && model.per_head_on_tensor_cores(pool)
    }) {
        prefill(len)?;
    }
    tracing::info!(ms = start.elapsed().as_millis() as u64, "kernels warmed up");
    Ok(())
}

/// The engine loop: take new requests, drop cancelled ones, plan and issue a step, hand
/// out the tokens of the step before; block while idle. Returns when the server side hangs
/// up.
///
/// With `overlap`, a step whose tokens are all drawn on the device is booked as run
/// ([`Scheduler::advance`]) and left in flight: the next step is planned and issued while
/// the device runs it, reading its tokens on the device, and only then are its tokens read
/// back and handed out. A step that needs the host between it and the next (rows of
/// logits, drafts, captured states) is waited for before the next is planned.
#[allow(clippy::too_many_arguments)]
fn run<'m, R: Runtime>(
    model: &'m GpuModel<R>,
    pool: &KvPool,
    host: &mut HostKv<'m>,
    sched: &mut Scheduler,
    requests: &Receiver<Submission>,
    vocab: usize,
    metrics: &Metrics,
    overlap: bool,
) {
    let mut in_flight: Option<InFlight> = None;
    // When the latest step's tokens were read: a step's time runs from then or from its
    // planning, whichever is later (an overlapped step is planned before the one before
    // it ends), so a step's time is what it adds to the run.
    let mut last_read = Instant::now();
    loop {
        // Idle: block for work (waking now and then to notice a closed channel).
        while in_flight.is_none() && sched.is_idle() {
            match requests.recv_timeout(Duration::from_millis(500)) {
                Ok(s) => sched.add(s),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(s) = requests.try_recv() {
            sched.add(s);
        }
        let start = Instant::now();
        sched.abort_cancelled();
        sched.abort_stalled(start);
        let Some(mut step) = sched.schedule() else {
            match in_flight.take() {
                Some(f) => f.finish(sched, vocab, metrics, &mut last_read),
                // Waiting requests that cannot start yet: wait for new work, not spin.
                None => std::thread::sleep(Duration::from_millis(1)),
            }
            continue;
        };
        let copied = host.apply(model.client(), pool, &step.copies);
        metrics
            .kv_host_copy_queue_pages
            .set(host.in_flight_pages() as f64);
        let planned = Instant::now();
        let launched = copied.and_then(|copied| {
            metrics.kv_bytes_to_host.add(copied.to_host);
            metrics.kv_bytes_to_device.add(copied.to_device);
            let previous = in_flight.as_ref().and_then(|f| f.launched.sampled());
            model.launch(&step.batch, pool, previous)
        });
        if let Some(graphs) = model.graph_stats() {
            metrics.record_graphs(graphs);
        }
        // The step before ends while this one runs.
        if let Some(f) = in_flight.take() {
            metrics.overlapped_steps.add(1);
            f.finish(sched, vocab, metrics, &mut last_read);
        }
        match launched {
            Ok(launched) => {
                if overlap && sched.can_overlap(&step) {
                    sched.advance(&mut step);
                }
                let f = InFlight {
                    step,
                    launched,
                    start,
                    schedule: planned - start,
                };
                match f.step.is_advanced() {
                    true => in_flight = Some(f),
                    false => f.finish(sched, vocab, metrics, &mut last_read),
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "step failed");
                sched.fail(step, &e.to_string());
            }
        }
    }
}

/// A step issued to the device whose tokens are still to be read.
struct InFlight<'m> {
    step: Step,
    launched: Launched<'m>,
    /// When its planning began, and how long planning took.
    start: Instant,
    schedule: Duration,
}

impl InFlight<'_> {
    /// Waits for the step, hands its tokens to the scheduler and records its times (the
    /// draft policy's from `last_read`, the time the step before's tokens were read, if
    /// later than its planning; moved to now).
    fn finish(
        self,
        sched: &mut Scheduler,
        vocab: usize,
        metrics: &Metrics,
        last_read: &mut Instant,
    ) {
        let InFlight {
            step,
            launched,
            start,
            schedule,
        } = self;
        let waited = Instant::now();
        let out = match launched.wait() {
            Ok(out) => out,
            Err(e) => {
                tracing::error!(error = %e, "step failed");
                return sched.fail(step, &e.to_string());
            }
        };
        let ran = Instant::now();
        let took = ran - start.max(*last_read);
        *last_read = ran;
        let kind = if step.is_decode() {
            StepKind::Decode
        } else {
            StepKind::Prefill
        };
        let shape = step.decode_shape();
        let scores = match step.batch.sampling {
            Some(_) => {
                let lp = out.logprobs.as_ref().map(|l| Logprobs {
                    token: &l.token,
                    top: l.top,
                    ids: &l.ids,
                    values: &l.values,
                });
                Scores::Tokens(&out.tokens, lp)
            }
            None => Scores::Logits(&out.logits, vocab),
        };
        sched.complete(step, scores);
        if let Some(shape) = shape {
            sched.observe_step(shape, took.as_secs_f64());
        }
        metrics.record_step(
            kind,
            schedule,
            Duration::from_secs_f64(out.issue_seconds),
            ran - waited,
            ran.elapsed(),
        );
    }
}

/// Tokens of KV the pool holds where the backend cannot say how much memory is free
/// (wgpu: llvmpipe in CI, a laptop's GPU).
const DEFAULT_KV_TOKENS: u64 = 65_536;
/// Largest buffer for one layer's cache (WebGPU's usual binding limit, 2 GiB).
const MAX_LAYER_BYTES: u64 = 2 << 30;

/// KV pages for the device's free memory less `reserve`, each layer's cache within
/// [`MAX_LAYER_BYTES`].
fn kv_pages_for(
    free: Option<u64>,
    reserve: u64,
    row_bytes: u64,
    layers: u64,
    page: usize,
) -> usize {
    let token_bytes = row_bytes * layers;
    let budget = match free {
        Some(free) => free.saturating_sub(reserve) / token_bytes,
        None => DEFAULT_KV_TOKENS,
    };
    let tokens = budget.min(MAX_LAYER_BYTES / row_bytes);
    (tokens as usize / page).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_takes_free_memory_less_the_reserve() {
        // 10 GiB free, 2 GiB reserved, 61 layers of 1152-byte rows (bf16 MLA KV).
        let pages = kv_pages_for(Some(10 << 30), 2 << 30, 1152, 61, 64);
        assert_eq!(pages, (8u64 << 30) as usize / (1152 * 61) / 64);
    }

    #[test]
    fn without_a_memory_figure_the_pool_holds_the_default() {
        assert_eq!(kv_pages_for(None, 0, 1152, 2, 64), 1024);
    }

    #[test]
    fn one_layer_cache_stays_within_the_largest_buffer() {
        let pages = kv_pages_for(Some(1 << 40), 0, 1152, 1, 64);
        assert_eq!(pages, ((2u64 << 30) / 1152) as usize / 64);
    }
}
