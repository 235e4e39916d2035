//! The tensors a DeepSeek-V3 architecture needs, by HF name, with the shapes its config
//! implies. Linear weights are `[out, in]`; how each is stored (bf16 or quantized) is read
//! from the file, not assumed.
use kiln_core::model::ModelConfig;

/// What a tensor is for, which decides how it may be stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A projection `[out, in]`: bf16, or NVFP4 / INT4 where the checkpoint quantizes it.
    Linear,
    /// Norm weights, biases, embeddings: never quantized.
    Plain,
}

/// One tensor the model needs.
#[derive(Clone, Debug)]
pub struct Needed {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
}

fn linear(name: String, out: usize, inp: usize) -> Needed {
    Needed {
        name,
        shape: vec![out, inp],
        role: Role::Linear,
    }
}

fn plain(name: String, shape: Vec<usize>) -> Needed {
    Needed {
        name,
        shape,
        role: Role::Plain,
    }
}

fn mlp(prefix: &str, hidden: usize, inter: usize, out: &mut Vec<Needed>) {
    out.push(linear(format!("{prefix}.gate_proj.weight"), inter, hidden));
    out.push(linear(format!("{prefix}.up_proj.weight"), inter, hidden));
    out.push(linear(format!("{prefix}.down_proj.weight"), hidden, inter));
}

fn attention(p: &str, c: &ModelConfig, out: &mut Vec<Needed>) {
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    match c.q_lora_rank {
        Some(r) => {
            out.push(linear(format!("{p}.q_a_proj.weight"), r, h));
            out.push(plain(format!("{p}.q_a_layernorm.weight"), vec![r]));
            out.push(linear(format!("{p}.q_b_proj.weight"), heads * qk, r));
        }
        None => out.push(linear(format!("{p}.q_proj.weight"), heads * qk, h)),
    }
    let kv_a = c.kv_lora_rank + c.qk_rope_head_dim;
    out.push(linear(format!("{p}.kv_a_proj_with_mqa.weight"), kv_a, h));
    out.push(plain(
        format!("{p}.kv_a_layernorm.weight"),
        vec![c.kv_lora_rank],
    ));
    let kv_b = heads * (c.qk_nope_head_dim + c.v_head_dim);
    out.push(linear(
        format!("{p}.kv_b_proj.weight"),
        kv_b,
        c.kv_lora_rank,
    ));
    out.push(linear(
        format!("{p}.o_proj.weight"),
        h,
        heads * c.v_head_dim,
    ));
}

/// Every tensor of the model, in layer order.
pub fn needed_tensors(c: &ModelConfig) -> Vec<Needed> {
    let h = c.hidden_size;
    let mut out = vec![plain(
        "model.embed_tokens.weight".into(),
        vec![c.vocab_size, h],
    )];
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        out.push(plain(format!("{p}.input_layernorm.weight"), vec![h]));
        attention(&format!("{p}.self_attn"), c, &mut out);
        out.push(plain(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
        ));
        if i < c.first_k_dense_replace {
            mlp(&format!("{p}.mlp"), h, c.intermediate_size, &mut out);
            continue;
        }
        out.push(plain(
            format!("{p}.mlp.gate.weight"),
            vec![c.n_routed_experts, h],
        ));
        out.push(plain(
            format!("{p}.mlp.gate.e_score_correction_bias"),
            vec![c.n_routed_experts],
        ));
        for e in 0..c.n_routed_experts {
            mlp(
                &format!("{p}.mlp.experts.{e}"),
                h,
                c.moe_intermediate_size,
                &mut out,
            );
        }
        if c.n_shared_experts > 0 {
            let inter = c.moe_intermediate_size * c.n_shared_experts;
            mlp(&format!("{p}.mlp.shared_experts"), h, inter, &mut out);
        }
    }
    out.push(plain("model.norm.weight".into(), vec![h]));
    if !c.tie_word_embeddings {
        out.push(linear("lm_head.weight".into(), c.vocab_size, h));
    }
    out
}
