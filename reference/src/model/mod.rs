//! The DeepSeek-V3 / Kimi-K2 language model (`DeepseekV3ForCausalLM`), naive, in f64:
//! token ids in, logits out.
//!
//! Computes, for one sequence at positions `0..len`:
//! `x = embed_tokens[tokens]`; per decoder layer
//! `x += mla(rmsnorm(x))` then `x += mlp(rmsnorm(x))`, where the MLP is a dense SwiGLU
//! for layers `< first_k_dense_replace` and the routed MoE plus shared experts after;
//! finally `logits = lm_head(rmsnorm(x))` (`lm_head` = `embed_tokens` when
//! `tie_word_embeddings`). Attention is the *unabsorbed* MLA that HF computes (see
//! `model/attention.rs`); the MoE router is [`crate::moe_gate`]'s.
//!
//! Follows HF transformers' `modeling_deepseek_v3.py` (5.x) term by term; where HF's
//! choices are not obvious they are noted at the code that matches them:
//! - `q_a_layernorm` and `kv_a_layernorm` use eps `1e-6` whatever `rms_norm_eps` says
//!   (HF, DeepSeek's and Kimi's own code all build them with the default eps);
//! - `rope_interleave`: HF rotates interleaved pairs and returns `[even | odd]` lanes,
//!   a permutation applied to both q and k that leaves every score unchanged; here the
//!   pairs are rotated in place ([`crate::rope::apply_interleaved_f64`]);
//! - softmax scale `qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2`
//!   ([`crate::rope::softmax_scale`]).
//!
//! Building [`ModelConfig::rope`] from an HF config (`rope_parameters` in files saved by
//! transformers 5, `rope_theta` + `rope_scaling` in released checkpoints): no scaling
//! or `rope_type` "default" is `factor` 1.0; "yarn" takes `factor`,
//! `original_max_position_embeddings`, `beta_fast`/`beta_slow` (HF defaults 32/1),
//! `mscale`, `mscale_all_dim`. HF scales cos/sin by the `mscale` ratio only when both
//! are present and non-zero, by `1 + 0.1 ln(factor)` otherwise, and squares
//! `mscale(factor, mscale_all_dim)` into the softmax scale only when `mscale_all_dim`
//! is non-zero: with `mscale_all_dim` missing, set `mscale` 1 and `mscale_all_dim` 0 to
//! match. A present `mscale_all_dim` without `mscale`, an explicit `attention_factor`
//! or `truncate: false` have no equivalent here.
//!
//! Precision: weights are read as f32 (the checkpoint's bf16 values, or NVFP4 experts
//! dequantized with [`crate::nvfp4::Nvfp4Matrix::dequantize`]); activations are f64
//! from the embedding on, every sum accumulates in f64. HF computes in f32, so it
//! agrees with this oracle to f32 rounding (~1e-6 relative per op) unless a routing
//! decision is within f32 rounding of a tie.

mod attention;
mod mlp;
#[cfg(test)]
mod tests;

use crate::norm::rmsnorm_f64;
use std::collections::HashMap;

pub use kiln_core::model::{ModelConfig, Tensor};

/// Where the model finds its weights, by HF checkpoint name
/// (e.g. `model.layers.0.self_attn.kv_b_proj.weight`).
pub trait Weights {
    /// The tensor called `name`; panics, naming it, if there is none.
    fn tensor(&self, name: &str) -> &Tensor;
}

impl Weights for HashMap<String, Tensor> {
    fn tensor(&self, name: &str) -> &Tensor {
        self.get(name)
            .unwrap_or_else(|| panic!("missing weight {name}"))
    }
}

/// The values of weight `name`, checked to have `shape`; panics naming the weight.
fn weight<'a, W: Weights>(w: &'a W, name: &str, shape: &[usize]) -> &'a [f32] {
    let t = w.tensor(name);
    assert_eq!(t.shape, shape, "weight {name} has shape {:?}", t.shape);
    assert_eq!(
        t.data.len(),
        shape.iter().product::<usize>(),
        "weight {name}"
    );
    &t.data
}

/// How the compressed KV rows (`[normalised latent | roped k_pe]`) are stored between
/// the projection and the attention. HF keeps them exact; an engine's bf16 or FlashMLA fp8
/// cache rounds them, and that rounding is the one difference between the two forwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvStorage {
    Exact,
    Bf16,
    /// FlashMLA's fp8 row (needs `kv_lora_rank` 512 and `qk_rope_head_dim` 64).
    Fp8,
}

/// Logits `[tokens.len(), vocab_size]` (row-major) of one sequence at positions
/// `0..tokens.len()`.
///
/// Panics if a weight is missing or misshapen, or a token is out of the vocabulary.
pub fn forward(cfg: &ModelConfig, weights: &impl Weights, tokens: &[u32]) -> Vec<f64> {
    forward_with_kv(cfg, weights, tokens, KvStorage::Exact)
}

/// [`forward`] with the KV rows rounded as `kv` stores them: the oracle of an engine that
/// keeps its KV cache in bf16 or fp8.
pub fn forward_with_kv(
    cfg: &ModelConfig,
    weights: &impl Weights,
    tokens: &[u32],
    kv: KvStorage,
) -> Vec<f64> {
    let states = hidden_states_with_kv(cfg, weights, tokens, kv);
    logits(
        cfg,
        weights,
        states.last().expect("at least the embeddings"),
    )
}

/// The residual stream `[tokens.len(), hidden_size]` after each stage: entry 0 is the
/// embeddings, entry `i + 1` the output of decoder layer `i` (before the final norm;
/// HF's `output_hidden_states` may differ in its last entry).
pub fn hidden_states(cfg: &ModelConfig, weights: &impl Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    hidden_states_with_kv(cfg, weights, tokens, KvStorage::Exact)
}

/// [`hidden_states`] with the KV rows stored as `kv`.
pub fn hidden_states_with_kv(
    cfg: &ModelConfig,
    weights: &impl Weights,
    tokens: &[u32],
    kv: KvStorage,
) -> Vec<Vec<f64>> {
    assert!(!tokens.is_empty(), "empty sequence");
    let mut states = vec![embed(cfg, weights, tokens)];
    for layer in 0..cfg.num_hidden_layers {
        let x = states.last().expect("non-empty");
        states.push(decoder_layer(cfg, weights, layer, x, tokens.len(), kv));
    }
    states
}

/// Rows of `model.embed_tokens.weight`, as f64.
fn embed(cfg: &ModelConfig, w: &impl Weights, tokens: &[u32]) -> Vec<f64> {
    let h = cfg.hidden_size;
    let table = weight(w, "model.embed_tokens.weight", &[cfg.vocab_size, h]);
    tokens
        .iter()
        .flat_map(|&t| {
            let t = t as usize;
            assert!(
                t < cfg.vocab_size,
                "token {t} >= vocab_size {}",
                cfg.vocab_size
            );
            table[t * h..(t + 1) * h].iter().map(|&v| v as f64)
        })
        .collect()
}

/// One pre-norm decoder layer on `x` (`[t, hidden]`).
fn decoder_layer(
    cfg: &ModelConfig,
    w: &impl Weights,
    layer: usize,
    x: &[f64],
    t: usize,
    kv: KvStorage,
) -> Vec<f64> {
    let h = cfg.hidden_size;
    let p = format!("model.layers.{layer}.");
    let norm = |x: &[f64], name: &str| {
        rmsnorm_f64(
            x,
            weight(w, &format!("{p}{name}.weight"), &[h]),
            cfg.rms_norm_eps,
        )
    };
    let attn = attention::mla(
        cfg,
        w,
        &format!("{p}self_attn."),
        &norm(x, "input_layernorm"),
        t,
        kv,
    );
    let x = add(x, &attn);
    let normed = norm(&x, "post_attention_layernorm");
    let mlp = if layer < cfg.first_k_dense_replace {
        mlp::swiglu(w, &format!("{p}mlp."), cfg.intermediate_size, h, &normed)
    } else {
        mlp::moe(cfg, w, &format!("{p}mlp."), &normed)
    };
    add(&x, &mlp)
}

/// `lm_head(norm(x))`: `[t, vocab]`.
fn logits(cfg: &ModelConfig, w: &impl Weights, x: &[f64]) -> Vec<f64> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let normed = rmsnorm_f64(x, weight(w, "model.norm.weight", &[h]), cfg.rms_norm_eps);
    let head = if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    crate::gemm::gemm_nt_f64(&normed, weight(w, head, &[v, h]), x.len() / h, v, h)
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Every weight [`forward`] reads, with its shape, in checkpoint order. NVFP4 experts
/// are read dequantized under their `.weight` name.
pub fn weight_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for layer in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{layer}.");
        out.push((format!("{p}input_layernorm.weight"), vec![h]));
        out.extend(attention::weight_shapes(cfg, &format!("{p}self_attn.")));
        out.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        if layer < cfg.first_k_dense_replace {
            out.extend(mlp::swiglu_shapes(
                &format!("{p}mlp."),
                cfg.intermediate_size,
                h,
            ));
        } else {
            out.extend(mlp::moe_shapes(cfg, &format!("{p}mlp.")));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}
