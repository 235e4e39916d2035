//! The forward pass: embedding, then per layer RMSNorm, absorbed MLA over the paged cache,
//! residual + RMSNorm (fused), dense MLP or MoE (router, dispatch, grouped experts, shared
//! expert, combine); final norm and lm_head. Every step is one of kiln's kernels.
use cubecl::prelude::*;
use kiln_kernels::activation::silu_mul;
use kiln_kernels::embedding::embedding;
use kiln_kernels::mla::{
    self, absorb_query, project_values, write_kv, PagedKvCache, MAX_DECODE_Q_LEN,
};
use kiln_kernels::moe::{combine, dispatch, gather_rows, route, Dispatch, Routing};
use kiln_kernels::rmsnorm::{add_rmsnorm, rmsnorm, rmsnorm_prefix};
use kiln_kernels::rope::{rope_inplace, RopeLayout};
use std::sync::atomic::Ordering;

use kiln_kernels::{DeviceArray, KernelError};

use super::batch::Plan;
use super::{Attention, Batch, Ffn, GpuModel, KvPool, Mlp, ModelError, Moe, QProj, StepOutput};

impl<R: Runtime> GpuModel<R> {
    /// Runs one step: appends the batch's tokens to the pool and returns their logits,
    /// `[tokens, vocab]` in request order.
    pub fn forward(&self, batch: &Batch, pool: &KvPool) -> Result<Vec<f32>, ModelError> {
        Ok(self.step(batch, pool)?.logits)
    }

    /// [`Self::forward`], also returning the hidden states of the layers in `batch.capture`.
    pub fn step(&self, batch: &Batch, pool: &KvPool) -> Result<StepOutput, ModelError> {
        let launches_before = self.launches.load(Ordering::Relaxed);
        let issue_start = std::time::Instant::now();
        if pool.caches.len() != self.layers.len() {
            return Err(ModelError::Batch(format!(
                "KV pool has {} layers, the model {}",
                pool.caches.len(),
                self.layers.len()
            )));
        }
        let plan = batch.plan(&self.client, self.config.vocab_size, pool)?;
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
            self.attention(&layer.attn, &x, &plan, &pool.caches[i], &delta)?;
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
        self.launched(self.lm_head.apply(cl, &x, rows, &logits))?;
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
        // Kernels run asynchronously: everything up to here was host work issuing them
        // (plus the reads of captured hidden states, which wait for the device).
        let issue_seconds = issue_start.elapsed().as_secs_f64();
        Ok(StepOutput {
            logits: logits.read(cl),
            hidden,
            launches: self.launches.load(Ordering::Relaxed) - launches_before,
            issue_seconds,
        })
    }

    /// Counts one kernel launch (every kiln kernel function launches exactly one kernel).
    fn launched<T>(&self, result: Result<T, KernelError>) -> Result<T, ModelError> {
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(result?)
    }

    /// A scratch buffer; every one in the forward pass is fully written by the kernel that
    /// produces it before anything reads it.
    fn scratch(&self, len: usize) -> DeviceArray<f32> {
        DeviceArray::uninit(&self.client, len)
    }

    fn attention(
        &self,
        a: &Attention,
        x: &DeviceArray<f32>,
        plan: &Plan,
        cache: &PagedKvCache,
        out: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let (cl, c) = (&self.client, &self.config);
        let t = plan.num_tokens;
        let heads = c.num_attention_heads;
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        // q_a_layernorm and kv_a_layernorm use 1e-6 whatever rms_norm_eps says (HF,
        // DeepSeek's and Kimi's code all hard-code it).
        let eps = 1e-6;
        let q = self.scratch(t * heads * qk);
        match &a.q {
            QProj::Lora { a: qa, norm, b } => {
                let lat = self.scratch(t * qa.n());
                self.launched(qa.apply(cl, x, t, &lat))?;
                let lat_n = self.scratch(t * qa.n());
                self.launched(rmsnorm(cl, &lat, t, norm, eps, &lat_n))?;
                self.launched(b.apply(cl, &lat_n, t, &q))?;
            }
            QProj::Direct(w) => self.launched(w.apply(cl, x, t, &q))?,
        }
        let rope = |buf: &DeviceArray<f32>, rows_per_token, row_stride, offset| {
            let layout = RopeLayout {
                tokens: t,
                rows_per_token,
                row_stride,
                offset,
                rope_dim: 64,
            };
            rope_inplace(
                cl,
                buf,
                layout,
                &plan.positions,
                &self.inv_freq,
                self.rope_scale,
            )
        };
        self.launched(rope(&q, heads, qk, c.qk_nope_head_dim))?;
        let kv_a = self.scratch(t * 576);
        self.launched(a.kv_a.apply(cl, x, t, &kv_a))?;
        self.launched(rope(&kv_a, 1, 576, 512))?;
        let kv_rows = self.scratch(t * 576);
        self.launched(rmsnorm_prefix(
            cl,
            &kv_a,
            t,
            576,
            &a.kv_a_norm,
            eps,
            &kv_rows,
        ))?;
        self.launched(write_kv(cl, &kv_rows, &plan.slots, cache))?;

        let q_abs = self.scratch(t * heads * 576);
        self.launched(absorb_query(cl, &q, t, &a.kv_b, self.kv_b_shape, &q_abs))?;
        let latent = self.scratch(t * heads * 512);
        let attend = if plan.meta.max_q_len <= MAX_DECODE_Q_LEN {
            mla::mla_decode
        } else {
            mla::mla_prefill
        };
        self.launched(attend(
            cl,
            &q_abs,
            heads,
            cache,
            &plan.meta,
            self.softmax_scale,
            &latent,
        ))?;
        let values = self.scratch(t * heads * c.v_head_dim);
        self.launched(project_values(
            cl,
            &latent,
            t,
            &a.kv_b,
            self.kv_b_shape,
            &values,
        ))?;
        self.launched(a.o.apply(cl, &values, t, out))?;
        Ok(())
    }

    fn mlp(
        &self,
        m: &Mlp,
        x: &DeviceArray<f32>,
        rows: usize,
        out: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let cl = &self.client;
        let inter = m.gate.n();
        let (g, u, act) = (
            self.scratch(rows * inter),
            self.scratch(rows * inter),
            self.scratch(rows * inter),
        );
        self.launched(m.gate.apply(cl, x, rows, &g))?;
        self.launched(m.up.apply(cl, x, rows, &u))?;
        self.launched(silu_mul(cl, &g, &u, &act))?;
        self.launched(m.down.apply(cl, &act, rows, out))?;
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
        self.launched(m.router.apply(cl, x, t, &logits))?;
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
        let inter = m.experts.gate.n();
        let (g, u, act) = (
            self.scratch(rows * inter),
            self.scratch(rows * inter),
            self.scratch(rows * inter),
        );
        self.launched(m.experts.gate.apply_grouped(cl, &xs, rows, &d.offsets, &g))?;
        self.launched(m.experts.up.apply_grouped(cl, &xs, rows, &d.offsets, &u))?;
        self.launched(silu_mul(cl, &g, &u, &act))?;
        let expert_out = self.scratch(rows * h);
        self.launched(
            m.experts
                .down
                .apply_grouped(cl, &act, rows, &d.offsets, &expert_out),
        )?;
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
