//! MLA attention of one layer: the queries (through q_lora or directly), the new KV rows
//! normalised and rotated into the cache, then each request in its form: absorbed (decode,
//! drafts, short chunks: queries absorbed, attention over the 576-wide rows, the latent
//! projected) or per head (long prefill spans, `kiln_kernels::mla::mla_prefill_heads`), a
//! step's two parts gathered apart and their values scattered back; `o_proj` last.
use cubecl::prelude::*;
use kiln_kernels::mla::{
    self, absorb_query, mla_prefill_heads, project_values, write_kv_normed, AttnMetadata,
    ContextRows, KvRowPrep, PagedKvCache, MAX_DECODE_Q_LEN,
};
use kiln_kernels::moe::{gather_rows, scatter_rows};
use kiln_kernels::rmsnorm::rmsnorm;
use kiln_kernels::rope::{rope_inplace, RopeLayout, Rotation};
use kiln_kernels::DeviceArray;

use super::batch::{Part, Plan};
use super::{Attention, GpuModel, ModelError, QProj};

impl<R: Runtime> GpuModel<R> {
    pub(super) fn attention(
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
                self.launched(qa.apply(cl, x, t, &lat, self.precision))?;
                let lat_n = self.scratch(t * qa.n());
                self.launched(rmsnorm(cl, &lat, t, norm, eps, &lat_n))?;
                self.launched(b.apply(cl, &lat_n, t, &q, self.precision))?;
            }
            QProj::Direct(w) => self.launched(w.apply(cl, x, t, &q, self.precision))?,
        }
        // The new KV rows are normalised and rotated on the way into the cache.
        let kv_a = self.scratch(t * 576);
        self.launched(a.kv_a.apply(cl, x, t, &kv_a, self.precision))?;
        let prep = KvRowPrep {
            norm: &a.kv_a_norm,
            eps,
            rope: Rotation {
                positions: &plan.positions,
                inv_freq: &self.inv_freq,
                scale: self.rope_scale,
            },
        };
        self.launched(write_kv_normed(cl, &kv_a, &prep, &plan.slots, cache))?;

        let values = self.scratch(t * heads * c.v_head_dim);
        match &plan.per_head {
            None => self.absorbed(a, &q, t, &plan.meta, &plan.positions, cache, &values)?,
            Some(split) => {
                self.part(&q, qk, &split.heads, &values, |q, tokens, out| {
                    self.per_head(a, q, tokens, &split.heads, &split.context, cache, out)
                })?;
                if let Some(rest) = &split.absorbed {
                    self.part(&q, qk, rest, &values, |q, tokens, out| {
                        self.absorbed(a, q, tokens, &rest.meta, &rest.positions, cache, out)
                    })?;
                }
            }
        }
        self.launched(a.o.apply(cl, &values, t, out, self.precision))?;
        Ok(())
    }

    /// Runs `attend` on `part`'s queries (`qk` per head, gathered from `q` unless the part
    /// is the whole batch) and puts its values (`[tokens, heads, v]`) into their rows of
    /// `values`.
    fn part(
        &self,
        q: &DeviceArray<f32>,
        qk: usize,
        part: &Part,
        values: &DeviceArray<f32>,
        attend: impl FnOnce(&DeviceArray<f32>, usize, &DeviceArray<f32>) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let cl = &self.client;
        let Some(rows) = &part.rows else {
            return attend(q, part.meta.num_tokens, values);
        };
        let (heads, v) = (self.config.num_attention_heads, self.config.v_head_dim);
        let tokens = rows.len();
        let q_part = self.scratch(tokens * heads * qk);
        self.launched(gather_rows(cl, q, heads * qk, rows, &q_part))?;
        let v_part = self.scratch(tokens * heads * v);
        attend(&q_part, tokens, &v_part)?;
        self.launched(scatter_rows(cl, &v_part, heads * v, rows, values))?;
        Ok(())
    }

    /// Absorbed MLA: the queries absorbed (their rope part rotated on the way), attention
    /// over the 576-wide cache rows, the latent output projected to values.
    #[allow(clippy::too_many_arguments)]
    fn absorbed(
        &self,
        a: &Attention,
        q: &DeviceArray<f32>,
        t: usize,
        meta: &AttnMetadata,
        positions: &DeviceArray<u32>,
        cache: &PagedKvCache,
        values: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let cl = &self.client;
        let heads = self.config.num_attention_heads;
        let rotation = Rotation {
            positions,
            inv_freq: &self.inv_freq,
            scale: self.rope_scale,
        };
        let q_abs = self.scratch(t * heads * 576);
        self.launched(absorb_query(
            cl,
            q,
            t,
            &a.kv_b,
            self.kv_b_shape,
            &rotation,
            &q_abs,
            self.precision,
        ))?;
        let latent = self.scratch(t * heads * 512);
        let attend = if meta.max_q_len <= MAX_DECODE_Q_LEN {
            mla::mla_decode
        } else {
            mla::mla_prefill
        };
        self.launched(attend(
            cl,
            &q_abs,
            heads,
            cache,
            meta,
            self.softmax_scale,
            &latent,
            self.precision,
        ))?;
        self.launched(project_values(
            cl,
            &latent,
            t,
            &a.kv_b,
            self.kv_b_shape,
            values,
            self.precision,
        ))?;
        Ok(())
    }

    /// Per-head MLA: the queries' rope part rotated in place, the context expanded by
    /// `kv_b_proj`, attention per head straight to values.
    #[allow(clippy::too_many_arguments)]
    fn per_head(
        &self,
        a: &Attention,
        q: &DeviceArray<f32>,
        t: usize,
        part: &Part,
        context: &ContextRows,
        cache: &PagedKvCache,
        values: &DeviceArray<f32>,
    ) -> Result<(), ModelError> {
        let (cl, c) = (&self.client, &self.config);
        let layout = RopeLayout {
            tokens: t,
            rows_per_token: c.num_attention_heads,
            row_stride: c.qk_nope_head_dim + c.qk_rope_head_dim,
            offset: c.qk_nope_head_dim,
            rope_dim: c.qk_rope_head_dim,
        };
        self.launched(rope_inplace(
            cl,
            q,
            layout,
            &part.positions,
            &self.inv_freq,
            self.rope_scale,
        ))?;
        self.launched(mla_prefill_heads(
            cl,
            q,
            cache,
            &part.meta,
            context,
            &a.kv_b,
            self.kv_b_shape,
            self.softmax_scale,
            values,
            self.precision,
        ))?;
        Ok(())
    }
}
