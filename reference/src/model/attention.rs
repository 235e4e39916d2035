//! Multi-head latent attention in its unabsorbed form, as HF's `DeepseekV3Attention`
//! computes it (eager, causal), in f64.
//!
//! For `t` tokens at positions `0..t`, with `H` heads, `dn = qk_nope_head_dim`,
//! `dr = qk_rope_head_dim`, `dv = v_head_dim`:
//! - `q = q_b_proj(q_a_layernorm(q_a_proj(x)))` (or `q_proj(x)` without `q_lora_rank`),
//!   viewed `[t, H, dn + dr]`; the last `dr` of each head are rotated (RoPE/YaRN);
//! - `kv_a_proj_with_mqa(x)` = `[latent (kv_lora_rank) | k_pe (dr)]`; `k_pe` is rotated
//!   once and shared by every head; `kv_b_proj(kv_a_layernorm(latent))` viewed
//!   `[t, H, dn + dv]` gives each head's `k_nope` and `v`;
//! - head `h` of query `i`: `softmax_j<=i(scale * [q_nope|q_pe] . [k_nope_j|k_pe_j]) v_j`;
//! - `o_proj` of the `[t, H * dv]` concatenation.
//!
//! The absorbed (MQA) form kiln's kernels use is the same function re-associated;
//! [`crate::mla`] is its oracle.

use super::KvStorage;
use super::{weight, ModelConfig, Weights};
use crate::gemm::gemm_nt_f64;
use crate::mla::{bf16_row_round, fp8_row_decode, fp8_row_encode};
use crate::norm::rmsnorm_f64;
use crate::rope::{apply_interleaved_f64, softmax_scale};
use crate::softmax::softmax_row;

/// Eps of `q_a_layernorm` and `kv_a_layernorm`: HF builds them with the default 1e-6
/// (not `rms_norm_eps`), as do DeepSeek's and Kimi's reference implementations.
const LATENT_NORM_EPS: f64 = 1e-6;

/// The attention block's output `[t, hidden]` for normed input `x` (`[t, hidden]`);
/// `prefix` is `model.layers.{i}.self_attn.`.
pub(super) fn mla(
    cfg: &ModelConfig,
    w: &impl Weights,
    prefix: &str,
    x: &[f64],
    t: usize,
    kv: KvStorage,
) -> Vec<f64> {
    let (h, nh, dv) = (cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim);
    let q = queries(cfg, w, prefix, x, t);
    let (k, v) = keys_values(cfg, w, prefix, x, t, kv);
    let scale = softmax_scale(cfg.qk_head_dim(), &cfg.rope);
    let out = causal_attention(&q, &k, &v, t, nh, scale);
    let o = weight(w, &format!("{prefix}o_proj.weight"), &[h, nh * dv]);
    gemm_nt_f64(&out, o, t, h, nh * dv)
}

/// `[t, H, dn + dr]` queries, rope part rotated.
fn queries(cfg: &ModelConfig, w: &impl Weights, prefix: &str, x: &[f64], t: usize) -> Vec<f64> {
    let (h, nh, dqk) = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim());
    let name = |n: &str| format!("{prefix}{n}.weight");
    let mut q = match cfg.q_lora_rank {
        None => gemm_nt_f64(
            x,
            weight(w, &name("q_proj"), &[nh * dqk, h]),
            t,
            nh * dqk,
            h,
        ),
        Some(r) => {
            let qa = gemm_nt_f64(x, weight(w, &name("q_a_proj"), &[r, h]), t, r, h);
            let qa = rmsnorm_f64(
                &qa,
                weight(w, &name("q_a_layernorm"), &[r]),
                LATENT_NORM_EPS,
            );
            gemm_nt_f64(
                &qa,
                weight(w, &name("q_b_proj"), &[nh * dqk, r]),
                t,
                nh * dqk,
                r,
            )
        }
    };
    rotate_tails(cfg, &mut q, t, dqk);
    q
}

/// Per-head `([t, H, dn + dr] keys, [t, H, dv] values)`.
fn keys_values(
    cfg: &ModelConfig,
    w: &impl Weights,
    prefix: &str,
    x: &[f64],
    t: usize,
    kv: KvStorage,
) -> (Vec<f64>, Vec<f64>) {
    let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
    let (dn, dr, dv, r) = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let name = |n: &str| format!("{prefix}{n}.weight");
    let kv_a = weight(w, &name("kv_a_proj_with_mqa"), &[r + dr, h]);
    let mut compressed = gemm_nt_f64(x, kv_a, t, r + dr, h);
    rotate_tails(cfg, &mut compressed, t, r + dr);
    let latent: Vec<f64> = compressed
        .chunks(r + dr)
        .flat_map(|row| row[..r].to_vec())
        .collect();
    let mut latent = rmsnorm_f64(
        &latent,
        weight(w, &name("kv_a_layernorm"), &[r]),
        LATENT_NORM_EPS,
    );
    store_rows(&mut latent, &mut compressed, r, dr, kv);
    let kv_b = weight(w, &name("kv_b_proj"), &[nh * (dn + dv), r]);
    let kv = gemm_nt_f64(&latent, kv_b, t, nh * (dn + dv), r);
    let (mut keys, mut values) = (
        Vec::with_capacity(t * nh * (dn + dr)),
        Vec::with_capacity(t * nh * dv),
    );
    for (i, row) in kv.chunks(nh * (dn + dv)).enumerate() {
        let k_pe = &compressed[i * (r + dr) + r..(i + 1) * (r + dr)];
        for head in row.chunks(dn + dv) {
            keys.extend_from_slice(&head[..dn]);
            keys.extend_from_slice(k_pe);
            values.extend_from_slice(&head[dn..]);
        }
    }
    (keys, values)
}

/// Rounds each token's `[latent | k_pe]` row as `kv` stores it (in place: `latent` is
/// `[t, r]`, `compressed` `[t, r + dr]` with k_pe in its last `dr` values).
fn store_rows(latent: &mut [f64], compressed: &mut [f64], r: usize, dr: usize, kv: KvStorage) {
    if kv == KvStorage::Exact {
        return;
    }
    for (lat, comp) in latent.chunks_mut(r).zip(compressed.chunks_mut(r + dr)) {
        let row: Vec<f32> = lat.iter().chain(&comp[r..]).map(|&v| v as f32).collect();
        let stored: Vec<f32> = match kv {
            KvStorage::Bf16 => bf16_row_round(&row),
            KvStorage::Fp8 => fp8_row_decode(&fp8_row_encode(&row)).to_vec(),
            KvStorage::Exact => unreachable!(),
        };
        for (d, v) in lat.iter_mut().zip(&stored[..r]) {
            *d = *v as f64;
        }
        for (d, v) in comp[r..].iter_mut().zip(&stored[r..]) {
            *d = *v as f64;
        }
    }
}

/// Rotates the last `qk_rope_head_dim` values of every `width`-wide row of `x`
/// (`[t, rows per token, width]`); row `j` of token `i` sits at position `i`.
fn rotate_tails(cfg: &ModelConfig, x: &mut [f64], t: usize, width: usize) {
    let dr = cfg.qk_rope_head_dim;
    let tails: Vec<f64> = x
        .chunks(width)
        .flat_map(|row| row[width - dr..].to_vec())
        .collect();
    let positions: Vec<usize> = (0..t).collect();
    let rotated = apply_interleaved_f64(&tails, &positions, dr, &cfg.rope);
    for (row, rot) in x.chunks_mut(width).zip(rotated.chunks(dr)) {
        row[width - dr..].copy_from_slice(rot);
    }
}

/// Causal softmax attention per head: `q`, `k` are `[t, H, dqk]`, `v` is `[t, H, dv]`;
/// returns `[t, H * dv]`.
fn causal_attention(q: &[f64], k: &[f64], v: &[f64], t: usize, nh: usize, scale: f64) -> Vec<f64> {
    let (dqk, dv) = (q.len() / (t * nh), v.len() / (t * nh));
    let mut out = vec![0.0f64; t * nh * dv];
    for i in 0..t {
        for head in 0..nh {
            let qi = &q[(i * nh + head) * dqk..][..dqk];
            let scores = (0..=i).map(|j| {
                let kj = &k[(j * nh + head) * dqk..][..dqk];
                scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
            });
            let probs = softmax_row(scores);
            let o = &mut out[(i * nh + head) * dv..][..dv];
            for (j, p) in probs.iter().enumerate() {
                let vj = &v[(j * nh + head) * dv..][..dv];
                o.iter_mut().zip(vj).for_each(|(acc, x)| *acc += p * x);
            }
        }
    }
    out
}

/// The weights [`mla`] reads under `prefix`, with their shapes.
pub(super) fn weight_shapes(cfg: &ModelConfig, prefix: &str) -> Vec<(String, Vec<usize>)> {
    let (h, nh, dqk) = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim());
    let (dn, dr, dv, r) = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    );
    let mut shapes = match cfg.q_lora_rank {
        None => vec![("q_proj", vec![nh * dqk, h])],
        Some(q) => vec![
            ("q_a_proj", vec![q, h]),
            ("q_a_layernorm", vec![q]),
            ("q_b_proj", vec![nh * dqk, q]),
        ],
    };
    shapes.extend([
        ("kv_a_proj_with_mqa", vec![r + dr, h]),
        ("kv_a_layernorm", vec![r]),
        ("kv_b_proj", vec![nh * (dn + dv), r]),
        ("o_proj", vec![h, nh * dv]),
    ]);
    shapes
        .into_iter()
        .map(|(n, s)| (format!("{prefix}{n}.weight"), s))
        .collect()
}
