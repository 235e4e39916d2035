//! The feed-forward blocks of DeepSeek-V3 in f64: the dense SwiGLU MLP and the MoE
//! (routed experts + shared experts), as HF's `DeepseekV3MLP` / `DeepseekV3MoE`.
//!
//! SwiGLU: `down_proj(silu(gate_proj(x)) * up_proj(x))`. MoE, per token:
//! `sum_{e in top-k} weight_e * expert_e(x) + shared_experts(x)`, where the router
//! ([`crate::moe_gate::route_f64`]) scores `gate.weight . x` (f64 here, f32 in HF) and
//! the shared experts are one SwiGLU `moe_intermediate_size * n_shared_experts` wide.

use super::{weight, ModelConfig, Weights};
use crate::activation::silu;
use crate::gemm::gemm_nt_f64;
use crate::moe_gate::{route_f64, GateConfig};

/// `down(silu(gate(x)) * up(x))` for `x` `[t, hidden]`; weights under `prefix`
/// (`...mlp.`, `...mlp.shared_experts.`, `...mlp.experts.{j}.`).
pub(super) fn swiglu(
    w: &impl Weights,
    prefix: &str,
    inter: usize,
    h: usize,
    x: &[f64],
) -> Vec<f64> {
    let t = x.len() / h;
    let name = |n: &str| format!("{prefix}{n}_proj.weight");
    let gate = gemm_nt_f64(x, weight(w, &name("gate"), &[inter, h]), t, inter, h);
    let up = gemm_nt_f64(x, weight(w, &name("up"), &[inter, h]), t, inter, h);
    let act: Vec<f64> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
    gemm_nt_f64(&act, weight(w, &name("down"), &[h, inter]), t, h, inter)
}

/// The router's hyper-parameters out of the model's.
fn gate_config(cfg: &ModelConfig) -> GateConfig {
    GateConfig {
        n_routed_experts: cfg.n_routed_experts,
        num_experts_per_tok: cfg.num_experts_per_tok,
        n_group: cfg.n_group,
        topk_group: cfg.topk_group,
        norm_topk_prob: cfg.norm_topk_prob,
        routed_scaling_factor: cfg.routed_scaling_factor,
    }
}

/// The MoE block's output `[t, hidden]` for normed input `x`; `prefix` is
/// `model.layers.{i}.mlp.`.
pub(super) fn moe(cfg: &ModelConfig, w: &impl Weights, prefix: &str, x: &[f64]) -> Vec<f64> {
    let (h, e, inter) = (
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
    );
    let t = x.len() / h;
    let router = weight(w, &format!("{prefix}gate.weight"), &[e, h]);
    let bias = weight(w, &format!("{prefix}gate.e_score_correction_bias"), &[e]);
    let routing = route_f64(&gemm_nt_f64(x, router, t, e, h), bias, &gate_config(cfg));
    let mut out = if cfg.n_shared_experts > 0 {
        let shared = format!("{prefix}shared_experts.");
        swiglu(w, &shared, inter * cfg.n_shared_experts, h, x)
    } else {
        vec![0.0; t * h]
    };
    let k = cfg.num_experts_per_tok;
    for (i, row) in x.chunks(h).enumerate() {
        let picks = routing.experts[i * k..(i + 1) * k].iter();
        for (&expert, &gate_weight) in picks.zip(&routing.weights[i * k..(i + 1) * k]) {
            let y = swiglu(w, &format!("{prefix}experts.{expert}."), inter, h, row);
            let o = &mut out[i * h..(i + 1) * h];
            o.iter_mut()
                .zip(&y)
                .for_each(|(acc, v)| *acc += gate_weight * v);
        }
    }
    out
}

/// The weights [`swiglu`] reads under `prefix`, with their shapes.
pub(super) fn swiglu_shapes(prefix: &str, inter: usize, h: usize) -> Vec<(String, Vec<usize>)> {
    vec![
        (format!("{prefix}gate_proj.weight"), vec![inter, h]),
        (format!("{prefix}up_proj.weight"), vec![inter, h]),
        (format!("{prefix}down_proj.weight"), vec![h, inter]),
    ]
}

/// The weights [`moe`] reads under `prefix`, with their shapes.
pub(super) fn moe_shapes(cfg: &ModelConfig, prefix: &str) -> Vec<(String, Vec<usize>)> {
    let (h, e, inter) = (
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
    );
    let mut out = vec![
        (format!("{prefix}gate.weight"), vec![e, h]),
        (format!("{prefix}gate.e_score_correction_bias"), vec![e]),
    ];
    for j in 0..e {
        out.extend(swiglu_shapes(&format!("{prefix}experts.{j}."), inter, h));
    }
    if cfg.n_shared_experts > 0 {
        let shared = inter * cfg.n_shared_experts;
        out.extend(swiglu_shapes(
            &format!("{prefix}shared_experts."),
            shared,
            h,
        ));
    }
    out
}
