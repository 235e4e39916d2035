//! The DeepSeek-V3 / Kimi-K2 architecture's hyper-parameters ([`ModelConfig`], named as in
//! the HF config) and a plain host tensor ([`Tensor`]): what the checkpoint loader, the
//! device model and the oracle's forward all take.

use crate::rope::YarnConfig;

/// A dense f32 tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Extent of each axis, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values, row-major.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of `shape` holding `data`; panics if the sizes disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        let n: usize = shape.iter().product();
        assert_eq!(data.len(), n, "shape {shape:?} needs {n} values");
        Self { shape, data }
    }
}

/// Model hyper-parameters, named as in the HF config.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Intermediate width of the dense MLP layers.
    pub intermediate_size: usize,
    /// Intermediate width of one routed expert (a shared expert block is
    /// `moe_intermediate_size * n_shared_experts` wide).
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `None`: queries come from `q_proj`; `Some(r)`: from `q_b_proj(norm(q_a_proj))`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    /// Layers `0..first_k_dense_replace` have a dense MLP, the others the MoE.
    pub first_k_dense_replace: usize,
    /// Eps of the input, post-attention and final norms.
    pub rms_norm_eps: f64,
    /// RoPE frequencies and YaRN scaling; `factor` 1.0 is plain RoPE.
    pub rope: YarnConfig,
    /// `lm_head` is `model.embed_tokens.weight` (no `lm_head.weight` is read).
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    /// Width of a query/key head: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The model cut to its first `layers` decoder layers (the dense ones among them stay
    /// dense): what a benchmark that cannot hold every layer serves.
    pub fn first_layers(&self, layers: usize) -> Self {
        ModelConfig {
            num_hidden_layers: layers,
            first_k_dense_replace: self.first_k_dense_replace.min(layers),
            ..self.clone()
        }
    }
}

impl ModelConfig {
    /// Kimi K2.x's text model (K2, K2.5, K2.6 share it): 61 layers (the first dense), 64
    /// heads, 384 routed experts of 2048 (top 8) plus one shared, vocabulary 163,840
    /// (`shared/ANCHORS.md`, from the released `config.json`).
    pub fn kimi_k2() -> Self {
        ModelConfig {
            vocab_size: 163_840,
            hidden_size: 7168,
            intermediate_size: 18432,
            moe_intermediate_size: 2048,
            num_hidden_layers: 61,
            num_attention_heads: 64,
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            n_routed_experts: 384,
            n_shared_experts: 1,
            num_experts_per_tok: 8,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.827,
            first_k_dense_replace: 1,
            rms_norm_eps: 1e-5,
            rope: YarnConfig::kimi_k2(),
            tie_word_embeddings: false,
        }
    }

    /// DeepSeek-V3: Kimi K2's shape with 128 heads, 256 routed experts in 8 groups (top 4
    /// groups), the first three layers dense, vocabulary 129,280.
    pub fn deepseek_v3() -> Self {
        ModelConfig {
            vocab_size: 129_280,
            num_attention_heads: 128,
            n_routed_experts: 256,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            first_k_dense_replace: 3,
            rms_norm_eps: 1e-6,
            rope: YarnConfig::deepseek_v3(),
            ..Self::kimi_k2()
        }
    }
}
