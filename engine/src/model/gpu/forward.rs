//! The forward pass: embedding, then per layer RMSNorm, MLA over the paged cache
//! (`attention.rs`), residual + RMSNorm (fused), dense MLP or MoE (router, dispatch, grouped
//! experts, shared expert, combine); final norm and lm_head; sampling on the device. Every
//! step is one of kiln's kernels.
use cubecl::prelude::*;
use kiln_kernels::embedding::embedding;
use kiln_kernels::gemm::gated_gemm;
use kiln_kernels::mla;
use kiln_kernels::moe::{combine, dispatch, gather_rows, route, Dispatch, Routing};
use kiln_kernels::rmsnorm::{add_rmsnorm, rmsnorm};
use kiln_kernels::sample::{feed_tokens, mask_logits, sample_rows, token_logprobs, NO_MASK};
use std::sync::atomic::Ordering;

use kiln_kernels::{DeviceArray, KernelError};

use super::batch::{Issued, Launched, Plan};
use super::{Batch, Ffn, GpuModel, KvPool, Mlp, ModelError, Moe, StepOutput};

/// Largest expansion of context rows into per-head keys and values (f32, plus their bf16
/// copy on tensor cores) the per-head form makes at once: WebGPU's usual largest buffer
/// binding, 2 GiB (Kimi: 32,768 context rows, 20,164 on tensor cores). Longer contexts are
/// expanded and attended in chunks of that many rows (`kiln_kernels::mla::ContextRows`).
const MAX_EXPANDED_BYTES: usize = 2 << 30;

impl<R: Runtime> GpuModel<R> {
    /// Runs one step: appends the batch's tokens to the pool and returns their logits,
    /// `[tokens, vocab]` in request order (empty for a step that samples on the device, [`Batch::sampling`]).
    pub fn forward(&self, batch: &Batch, pool: &KvPool) -> Result<Vec<f32>, ModelError> {
        Ok(self.step(batch, pool)?.logits)
    }

    /// [`Self::forward`], also returning the hidden states of the layers in `batch.capture`.
    pub fn step(&self, batch: &Batch, pool: &KvPool) -> Result<StepOutput, ModelError> {
        self.launch(batch, pool, None)?.wait()
    }

    /// Issues one step and returns without waiting for it: its outputs' reads are enqueued
    /// behind its kernels, so the host can plan and issue the next step (which may take
    /// input ids from this one's [`Launched::sampled`]) while the device runs this one.
    /// `previous`: the sampled tokens [`Batch::from_previous`] reads. A decode step replays
    /// a CUDA graph where the model keeps them ([`GpuModel::enable_graphs`]).
    pub fn launch(
        &self,
        batch: &Batch,
        pool: &KvPool,
        previous: Option<&DeviceArray<u32>>,
    ) -> Result<Launched<'_>, ModelError> {
        let launches_before = self.launches.load(Ordering::Relaxed);
        let issue_start = std::time::Instant::now();
        if pool.caches.len() != self.layers.len() {
            return Err(ModelError::Batch(format!(
                "KV pool has {} layers, the model {}",
                pool.caches.len(),
                self.layers.len()
            )));
        }
        #[cfg(feature = "cuda")]
        if let Some((reads, rows)) = self.replayed(batch, pool, previous)? {
            return Ok(Launched {
                reads,
                hidden: Vec::new(),
                rows: Some(rows),
                launches: self.launches.load(Ordering::Relaxed) - launches_before,
                issue_seconds: issue_start.elapsed().as_secs_f64(),
            });
        }
        let plan = self.plan(batch, pool)?;
        let cl = &self.client;
        if !batch.from_previous.is_empty() {
            self.fed(previous, &batch.from_previous, &plan.tokens)?;
        }
        let rows = plan.last_rows.as_ref().map_or(plan.num_tokens, |l| l.len());
        let params = self.sampling_params(batch, rows)?;
        let issued = self.issue(&plan, pool, params.as_ref(), batch)?;
        Ok(Launched {
            reads: issued.reads(cl),
            hidden: issued.hidden,
            rows: None,
            launches: self.launches.load(Ordering::Relaxed) - launches_before,
            issue_seconds: issue_start.elapsed().as_secs_f64(),
        })
    }

    /// The input ids `from_previous` names, read from `previous` into `tokens`.
    pub(super) fn fed(
        &self,
        previous: Option<&DeviceArray<u32>>,
        from_previous: &[(usize, usize)],
        tokens: &DeviceArray<u32>,
    ) -> Result<(), ModelError> {
        let previous = previous.ok_or_else(|| {
            ModelError::Batch("tokens fed from a previous step that sampled none".into())
        })?;
        self.launched(feed_tokens(&self.client, previous, from_previous, tokens))
    }

    /// The batch's sampling rows on the device (`None`: it returns logits), checked against
    /// the `rows` rows of logits the step makes.
    pub(super) fn sampling_params(
        &self,
        batch: &Batch,
        rows: usize,
    ) -> Result<Option<DeviceArray<u32>>, ModelError> {
        match &batch.sampling {
            None => Ok(None),
            Some(sampling) if sampling.len() != rows => Err(ModelError::Batch(format!(
                "{} sampling rows for {rows} rows of logits",
                sampling.len()
            ))),
            Some(sampling) => {
                let words: Vec<u32> = sampling.iter().flat_map(|r| r.words()).collect();
                Ok(Some(DeviceArray::upload(&self.client, &words)))
            }
        }
    }

    /// The step's kernels over `plan` (`batch` laid out), from the embedding to the
    /// sampled tokens (with `params`) or the logits; also reads the hidden states of the
    /// layers `batch` captures. Launches kernels only (besides those reads and the upload
    /// of the batch's masks), so a decode step's call can be recorded into a CUDA graph.
    pub(super) fn issue(
        &self,
        plan: &Plan,
        pool: &KvPool,
        params: Option<&DeviceArray<u32>>,
        batch: &Batch,
    ) -> Result<Issued, ModelError> {
        let (cl, c) = (&self.client, &self.config);
        let t = plan.num_tokens;
        let eps = c.rms_norm_eps as f32;
        let residual = self.scratch(t * c.hidden_size);
        self.launched(embedding(
            cl,
            &self.embed,
            c.vocab_size,
            c.hidden_size,
            &plan.tokens,
            &residual,
        ))?;
        let x = self.scratch(t * c.hidden_size);
        let delta = self.scratch(t * c.hidden_size);
        let mut captured = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                self.launched(rmsnorm(cl, &residual, t, &layer.input_norm, eps, &x))?;
            } else {
                self.launched(add_rmsnorm(
                    cl,
                    &residual,
                    &delta,
                    t,
                    &layer.input_norm,
                    eps,
                    &x,
                ))?;
            }
            self.attention(&layer.attn, &x, plan, &pool.caches[i], &delta)?;
            self.all_reduced(t)?;
            self.launched(add_rmsnorm(
                cl,
                &residual,
                &delta,
                t,
                &layer.post_norm,
                eps,
                &x,
            ))?;
            match &layer.ffn {
                Ffn::Dense(mlp) => self.mlp(mlp, &x, t, &delta)?,
                Ffn::Moe(moe) => self.moe(moe, &x, t, &delta)?,
            }
            self.all_reduced(t)?;
            if batch.capture.contains(&i) {
                // The layer's output is residual + delta; the device adds them in the next
                // fused norm, the host adds them here (the same f32 sum).
                let (r, d) = (residual.read(cl), delta.read(cl));
                captured.push((i, r.iter().zip(&d).map(|(a, b)| a + b).collect()));
            }
        }
        self.launched(add_rmsnorm(cl, &residual, &delta, t, &self.norm, eps, &x))?;
        let (rows, x) = match &plan.last_rows {
            Some(last) => {
                let picked = self.scratch(last.len() * c.hidden_size);
                self.launched(gather_rows(cl, &x, c.hidden_size, last, &picked))?;
                (last.len(), picked)
            }
            None => (t, x),
        };
        let logits = self.scratch(rows * c.vocab_size);
        self.launched(self.lm_head.apply(cl, &x, rows, &logits, self.precision))?;
        let hidden = batch
            .capture
            .iter()
            .map(|l| {
                captured
                    .iter()
                    .find(|(i, _)| i == l)
                    .cloned()
                    .expect("captured above")
            })
            .collect();
        let sampled = match params {
            None => None,
            Some(params) => {
                let ids = DeviceArray::<u32>::uninit(cl, rows);
                let drawn_from = self.masked(&logits, rows, &batch.masks)?;
                let drawn_from = drawn_from.as_ref().unwrap_or(&logits);
                self.launched(sample_rows(
                    cl,
                    drawn_from,
                    rows,
                    c.vocab_size,
                    params,
                    &ids,
                ))?;
                let logprobs = match batch.logprobs {
                    Some(top) => {
                        let lp = [rows, rows * top, rows * top];
                        let (token, values) = (self.scratch(lp[0]), self.scratch(lp[2]));
                        let top_ids = DeviceArray::<u32>::uninit(cl, lp[1]);
                        self.launched(token_logprobs(
                            cl,
                            &logits,
                            rows,
                            c.vocab_size,
                            &ids,
                            top,
                            &token,
                            &top_ids,
                            &values,
                        ))?;
                        Some((token, top, top_ids, values))
                    }
                    None => None,
                };
                Some((ids, logprobs))
            }
        };
        Ok(Issued {
            logits,
            sampled,
            hidden,
        })
    }

    /// `logits` (`rows` rows) with `masks` applied ([`Batch::masks`]), or `None` without
    /// masks.
    fn masked(
        &self,
        logits: &DeviceArray<f32>,
        rows: usize,
        masks: &[(usize, Vec<u32>)],
    ) -> Result<Option<DeviceArray<f32>>, ModelError> {
        if masks.is_empty() {
            return Ok(None);
        }
        let (cl, vocab) = (&self.client, self.config.vocab_size);
        let words = vocab.div_ceil(32);
        let mut mask_of_row = vec![NO_MASK; rows];
        let mut bits = Vec::with_capacity(masks.len() * words);
        for (i, (row, allowed)) in masks.iter().enumerate() {
            match mask_of_row.get_mut(*row) {
                Some(m) if *m == NO_MASK => *m = i as u32,
                _ => {
                    return Err(ModelError::Batch(format!(
                        "a mask for row {row} of {rows}, or a second one"
                    )))
                }
            }
            bits.extend((0..words).map(|w| allowed.get(w).copied().unwrap_or(0)));
        }
        let out = self.scratch(rows * vocab);
        let bits = DeviceArray::upload(cl, &bits);
        self.launched(mask_logits(
            cl,
            logits,
            rows,
            vocab,
            &bits,
            &mask_of_row,
            &out,
        ))?;
        Ok(Some(out))
    }

    /// True when requests prefilling into `pool` attend per head on tensor cores
    /// (`mla::heads_on_tensor_cores`: CUDA at bf16 with a bf16 or fp8 cache).
    pub fn per_head_on_tensor_cores(&self, pool: &KvPool) -> bool {
        self.per_head_from.is_some()
            && pool.caches.first().is_some_and(|c| {
                mla::heads_on_tensor_cores(&self.client, c.format, self.precision, self.kv_b_shape)
            })
    }

    /// Lays `batch` out for `pool`, with the requests that attend per head split off where
    /// this device takes the per-head form ([`GpuModel::set_per_head_from`]), their contexts
    /// expanded in chunks of [`MAX_EXPANDED_BYTES`]. Where the absorbed kernels run
    /// on tensor cores, the per-head form must too (`mla::heads_on_tensor_cores`): the
    /// portable per-head kernel would be slower than the absorbed tensor-core one.
    pub(super) fn plan(&self, batch: &Batch, pool: &KvPool) -> Result<Plan, ModelError> {
        let s = self.kv_b_shape;
        let absorbed_tc = pool
            .caches
            .first()
            .is_some_and(|c| mla::uses_tensor_cores(&self.client, c.format, self.precision));
        let heads_tc = self.per_head_on_tensor_cores(pool);
        // f32 expansion, and its bf16 copy for the tensor cores.
        let mut row_bytes = s.heads * (s.nope + s.v) * 4;
        if heads_tc {
            row_bytes += s.heads * (s.nope + 64 + s.v) * 2;
        }
        let per_head = (self.per_head_from)
            .filter(|_| !absorbed_tc || heads_tc)
            .map(|from| (from, MAX_EXPANDED_BYTES / row_bytes.max(1)));
        batch.plan(&self.client, self.config.vocab_size, pool, per_head)
    }

    /// Counts one kernel call: one launch, except split-K GEMMs and the prefill-sized MoE
    /// dispatch, which launch two.
    pub(super) fn launched<T>(&self, result: Result<T, KernelError>) -> Result<T, ModelError> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(result?)
    }

    /// The stand-in of a rank's all-reduce of `t` tokens' bf16 hidden states, if any.
    pub(super) fn all_reduced(&self, t: usize) -> Result<(), ModelError> {
        match &self.all_reduce {
            Some(a) => self.launched(a.run(&self.client, t * self.config.hidden_size * 2)),
            None => Ok(()),
        }
    }

    /// A scratch buffer; every one in the forward pass is fully written by the kernel that
    /// produces it before anything reads it.
    pub(super) fn scratch(&self, len: usize) -> DeviceArray<f32> {
        DeviceArray::uninit(&self.client, len)
    }

    fn mlp(
        &self,
        m: &Mlp,
        x: &DeviceArray<f32>,
        rows: usize,
        out: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let cl = &self.client;
        let act = self.scratch(rows * m.gate.n());
        self.launched(gated_gemm(
            cl,
            x,
            rows,
            m.gate.operand(),
            m.up.operand(),
            None,
            &act,
            self.precision,
        ))?;
        self.launched(m.down.apply(cl, &act, rows, out, self.precision))?;
        Ok(())
    }

    fn moe(
        &self,
        m: &Moe,
        x: &DeviceArray<f32>,
        t: usize,
        out: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let (cl, c) = (&self.client, &self.config);
        let (e, k, h) = (c.n_routed_experts, c.num_experts_per_tok, c.hidden_size);
        let logits = self.scratch(t * e);
        self.launched(m.router.apply(cl, x, t, &logits, self.precision))?;
        let routing = Routing {
            experts: DeviceArray::uninit(cl, t * k),
            weights: self.scratch(t * k),
        };
        self.launched(route(cl, &logits, &m.bias, t, &self.gate, &routing))?;
        let d = Dispatch {
            offsets: DeviceArray::uninit(cl, e + 1),
            slot: DeviceArray::uninit(cl, t * k),
            source: DeviceArray::uninit(cl, t * k),
        };
        self.launched(dispatch(cl, &routing.experts, e, k, &d))?;
        let rows = t * k;
        let xs = self.scratch(rows * h);
        self.launched(gather_rows(cl, x, h, &d.source, &xs))?;
        let act = self.scratch(rows * m.experts.gate.n());
        self.launched(gated_gemm(
            cl,
            &xs,
            rows,
            m.experts.gate.operand(),
            m.experts.up.operand(),
            Some(&d.offsets),
            &act,
            self.precision,
        ))?;
        let expert_out = self.scratch(rows * h);
        self.launched(m.experts.down.apply_grouped(
            cl,
            &act,
            rows,
            &d.offsets,
            &expert_out,
            self.precision,
        ))?;
        let shared = match &m.shared {
            Some(s) => {
                let so = self.scratch(t * h);
                self.mlp(s, x, t, &so)?;
                Some(so)
            }
            None => None,
        };
        self.launched(combine(
            cl,
            &expert_out,
            &d.slot,
            &routing.weights,
            shared.as_ref(),
            t,
            h,
            out,
        ))?;
        Ok(())
    }
}

/// One tensor-parallel rank's share of a step, run piece by piece so that the caller
/// (`crate::model::tp`) can all-reduce between the pieces: [`GpuModel::rank_step`] plans the
/// batch and embeds its tokens into `residual`; per layer, [`RankStep::attention`] and
/// [`RankStep::ffn`] each write this rank's partial block output into `delta`;
/// [`RankStep::logits`] applies the final norm and lm_head. Between pieces the caller replaces
/// `residual` (after embedding) and `delta` (after each block) with their sums over the
/// ranks; with those sums being the identity (one rank), the kernels are those of
/// [`GpuModel::step`] in the same order.
pub(crate) struct RankStep<'a, R: Runtime> {
    model: &'a GpuModel<R>,
    pool: &'a KvPool,
    plan: Plan,
    /// The residual stream; right after [`GpuModel::rank_step`], this rank's partial embedding.
    pub(crate) residual: DeviceArray<f32>,
    /// The output of the last attention or FFN block: this rank's partial sum until reduced.
    pub(crate) delta: DeviceArray<f32>,
    /// The normalised input of the next block.
    x: DeviceArray<f32>,
}

impl<R: Runtime> GpuModel<R> {
    /// Starts this rank's share of a step: plans `batch` against `pool` (one cache per layer)
    /// and embeds its tokens into [`RankStep::residual`].
    pub(crate) fn rank_step<'a>(
        &'a self,
        batch: &Batch,
        pool: &'a KvPool,
    ) -> Result<RankStep<'a, R>, ModelError> {
        let c = &self.config;
        let plan = self.plan(batch, pool)?;
        let len = plan.num_tokens * c.hidden_size;
        let residual = self.scratch(len);
        self.launched(embedding(
            &self.client,
            &self.embed,
            c.vocab_size,
            c.hidden_size,
            &plan.tokens,
            &residual,
        ))?;
        Ok(RankStep {
            model: self,
            pool,
            plan,
            residual,
            delta: self.scratch(len),
            x: self.scratch(len),
        })
    }
}

impl<R: Runtime> RankStep<'_, R> {
    /// Layer `layer`'s input norm (adding `delta` to the residual first, except at layer 0)
    /// and its attention over this rank's heads, into `delta`.
    pub(crate) fn attention(&self, layer: usize) -> Result<(), ModelError> {
        let (m, t) = (self.model, self.plan.num_tokens);
        let (l, eps) = (&m.layers[layer], m.config.rms_norm_eps as f32);
        if layer == 0 {
            m.launched(rmsnorm(
                &m.client,
                &self.residual,
                t,
                &l.input_norm,
                eps,
                &self.x,
            ))?;
        } else {
            m.launched(add_rmsnorm(
                &m.client,
                &self.residual,
                &self.delta,
                t,
                &l.input_norm,
                eps,
                &self.x,
            ))?;
        }
        m.attention(
            &l.attn,
            &self.x,
            &self.plan,
            &self.pool.caches[layer],
            &self.delta,
        )
    }

    /// Layer `layer`'s post-attention norm (after adding `delta`) and its MLP or MoE over
    /// this rank's slice of the intermediate width, into `delta`.
    pub(crate) fn ffn(&self, layer: usize) -> Result<(), ModelError> {
        let (m, t) = (self.model, self.plan.num_tokens);
        let (l, eps) = (&m.layers[layer], m.config.rms_norm_eps as f32);
        m.launched(add_rmsnorm(
            &m.client,
            &self.residual,
            &self.delta,
            t,
            &l.post_norm,
            eps,
            &self.x,
        ))?;
        match &l.ffn {
            Ffn::Dense(mlp) => m.mlp(mlp, &self.x, t, &self.delta),
            Ffn::Moe(moe) => m.moe(moe, &self.x, t, &self.delta),
        }
    }

    /// The final norm (after adding `delta`) and lm_head over this rank's vocabulary rows:
    /// `[rows, vocab]`, a row per token or per request as the batch's `logits` asks.
    pub(crate) fn logits(self) -> Result<Vec<f32>, ModelError> {
        let (m, t) = (self.model, self.plan.num_tokens);
        let (cl, c) = (&m.client, &m.config);
        m.launched(add_rmsnorm(
            cl,
            &self.residual,
            &self.delta,
            t,
            &m.norm,
            c.rms_norm_eps as f32,
            &self.x,
        ))?;
        let (rows, x) = match &self.plan.last_rows {
            Some(last) => {
                let picked = m.scratch(last.len() * c.hidden_size);
                m.launched(gather_rows(cl, &self.x, c.hidden_size, last, &picked))?;
                (last.len(), picked)
            }
            None => (t, self.x),
        };
        let logits = m.scratch(rows * c.vocab_size);
        m.launched(m.lm_head.apply(cl, &x, rows, &logits, m.precision))?;
        Ok(logits.read(cl))
    }
}
