//! `config.json` of an HF model directory, parsed into the architecture the reference and
//! the kernels use.
//!
//! Accepted: DeepSeek-V3 fields (`model_type` `deepseek_v3`), Kimi K2's `kimi_k2` (same
//! fields), and Kimi K2.5's `kimi_k25`, which nests the text model under `text_config`.
//! `quantization_config` may sit at either level. Field names are HF's.
use std::path::Path;

use kiln_core::model::ModelConfig;
use kiln_core::rope::YarnConfig;
use serde::Deserialize;

use super::weights::LoadError;

/// How the checkpoint's large linear weights are stored, per `quantization_config`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum QuantMethod {
    /// No quantization: bf16 (or f32) weights.
    None,
    /// NVIDIA ModelOpt NVFP4 (`weight`, `weight_scale`, `weight_scale_2`, `input_scale`).
    ModelOptNvfp4,
    /// compressed-tensors with the given format (`nvfp4-pack-quantized`, `pack-quantized`).
    CompressedTensors(String),
    /// DeepSeek-V3's FP8: E4M3 weights with an f32 `weight_scale_inv` per block of
    /// `block = [rows, cols]` (`weight_block_size`, 128 x 128 as released).
    Fp8Block { block: [usize; 2] },
}

/// The model a directory declares.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub model_type: String,
    pub arch: ModelConfig,
    pub quant: QuantMethod,
    /// Tokens that end a generation (`eos_token_id`, a number or a list).
    pub eos_token_ids: Vec<u32>,
    /// Longest context: `max_position_embeddings`, else YaRN's factor times the original
    /// length.
    pub context_len: usize,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// `rope_scaling` (transformers 4 and the original checkpoints) or `rope_parameters`
/// (transformers 5, which also moves `rope_theta` inside). The kind is `type` in older
/// configs and `rope_type` in newer ones; transformers 5 writes both.
#[derive(Deserialize)]
struct RopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    beta_fast: Option<f64>,
    beta_slow: Option<f64>,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
}

impl RopeScaling {
    /// The rope kind, from whichever spelling the config has; both must agree.
    fn kind(&self) -> Result<Option<&str>, String> {
        match (self.rope_type.as_deref(), self.legacy_type.as_deref()) {
            (Some(a), Some(b)) if a != b => Err(format!(
                "rope_scaling names two kinds: rope_type {a:?} and type {b:?}"
            )),
            (a, b) => Ok(a.or(b)),
        }
    }
}

#[derive(Deserialize)]
struct QuantConfig {
    quant_method: Option<String>,
    format: Option<String>,
    /// FP8: the element format (`e4m3`) and the scales' block shape.
    fmt: Option<String>,
    weight_block_size: Option<Vec<usize>>,
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    text_config: Option<Box<RawConfig>>,
    quantization_config: Option<QuantConfig>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    moe_intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: Option<bool>,
    routed_scaling_factor: Option<f64>,
    first_k_dense_replace: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeScaling>,
    rope_parameters: Option<RopeScaling>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    eos_token_id: Option<TokenIds>,
}

const SUPPORTED: [&str; 3] = ["deepseek_v3", "kimi_k2", "kimi_k25"];

impl ModelSpec {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json(&text).map_err(|reason| LoadError::Config { path, reason })
    }

    /// Parses the text of a `config.json`; the error says which field is wrong.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let outer: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let outer_type = outer.model_type.clone().unwrap_or_default();
        if !SUPPORTED.contains(&outer_type.as_str()) {
            return Err(format!(
                "model_type {outer_type:?} is not supported (expected one of {SUPPORTED:?})"
            ));
        }
        let outer_quant = outer
            .quantization_config
            .as_ref()
            .map(quant_method)
            .transpose()?;
        let outer_eos = outer.eos_token_id.as_ref().map(eos_list);
        let text_cfg = match outer.text_config {
            Some(inner) => *inner,
            None if outer_type == "kimi_k25" => {
                return Err("model_type kimi_k25 needs a text_config".into())
            }
            None => outer,
        };
        let quant = match text_cfg
            .quantization_config
            .as_ref()
            .map(quant_method)
            .transpose()?
        {
            Some(q) => q,
            None => outer_quant.unwrap_or(QuantMethod::None),
        };
        let eos_token_ids = text_cfg
            .eos_token_id
            .as_ref()
            .map(eos_list)
            .or(outer_eos)
            .unwrap_or_default();
        let arch = architecture(&text_cfg)?;
        let context_len = text_cfg.max_position_embeddings.unwrap_or(
            (arch.rope.factor * arch.rope.original_max_position_embeddings as f64) as usize,
        );
        Ok(ModelSpec {
            context_len,
            model_type: outer_type,
            arch,
            quant,
            eos_token_ids,
        })
    }
}

fn eos_list(ids: &TokenIds) -> Vec<u32> {
    match ids {
        TokenIds::One(id) => vec![*id],
        TokenIds::Many(ids) => ids.clone(),
    }
}

fn quant_method(q: &QuantConfig) -> Result<QuantMethod, String> {
    match q.quant_method.as_deref() {
        Some("modelopt") => Ok(QuantMethod::ModelOptNvfp4),
        Some("compressed-tensors") => Ok(QuantMethod::CompressedTensors(
            q.format.clone().unwrap_or_default(),
        )),
        Some("fp8") => {
            if let Some(fmt) = q.fmt.as_deref().filter(|f| *f != "e4m3") {
                return Err(format!(
                    "quantization_config.fmt {fmt:?}: only e4m3 FP8 is supported"
                ));
            }
            let block = match q.weight_block_size.as_deref() {
                None => [128, 128],
                Some(&[rows, cols]) if rows > 0 && cols > 0 => [rows, cols],
                Some(other) => {
                    return Err(format!(
                        "quantization_config.weight_block_size {other:?} must be two positive sizes"
                    ))
                }
            };
            Ok(QuantMethod::Fp8Block { block })
        }
        other => Err(format!(
            "quantization_config.quant_method {other:?} is not supported"
        )),
    }
}

fn need<T>(value: Option<T>, field: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing field {field}"))
}

fn architecture(c: &RawConfig) -> Result<ModelConfig, String> {
    let scaling = c.rope_parameters.as_ref().or(c.rope_scaling.as_ref());
    let rope_theta = scaling
        .and_then(|s| s.rope_theta)
        .or(c.rope_theta)
        .unwrap_or(10000.0);
    let kind = scaling.map(RopeScaling::kind).transpose()?.flatten();
    let rope = match scaling {
        Some(_) if kind == Some("default") => plain_rope(c, rope_theta),
        Some(s) if kind.is_none_or(|t| t == "yarn") => YarnConfig {
            rope_theta,
            factor: s.factor.unwrap_or(1.0),
            original_max_position_embeddings: need(
                s.original_max_position_embeddings,
                "rope_scaling.original_max_position_embeddings",
            )?,
            beta_fast: s.beta_fast.unwrap_or(32.0),
            beta_slow: s.beta_slow.unwrap_or(1.0),
            mscale: s.mscale.unwrap_or(1.0),
            mscale_all_dim: s.mscale_all_dim.unwrap_or(0.0),
        },
        Some(_) => {
            return Err(format!("rope_scaling type {kind:?} is not supported"));
        }
        None => plain_rope(c, rope_theta),
    };
    let cfg = ModelConfig {
        vocab_size: need(c.vocab_size, "vocab_size")?,
        hidden_size: need(c.hidden_size, "hidden_size")?,
        intermediate_size: need(c.intermediate_size, "intermediate_size")?,
        moe_intermediate_size: need(c.moe_intermediate_size, "moe_intermediate_size")?,
        num_hidden_layers: need(c.num_hidden_layers, "num_hidden_layers")?,
        num_attention_heads: need(c.num_attention_heads, "num_attention_heads")?,
        q_lora_rank: c.q_lora_rank,
        kv_lora_rank: need(c.kv_lora_rank, "kv_lora_rank")?,
        qk_nope_head_dim: need(c.qk_nope_head_dim, "qk_nope_head_dim")?,
        qk_rope_head_dim: need(c.qk_rope_head_dim, "qk_rope_head_dim")?,
        v_head_dim: need(c.v_head_dim, "v_head_dim")?,
        n_routed_experts: need(c.n_routed_experts, "n_routed_experts")?,
        n_shared_experts: need(c.n_shared_experts, "n_shared_experts")?,
        num_experts_per_tok: need(c.num_experts_per_tok, "num_experts_per_tok")?,
        n_group: need(c.n_group, "n_group")?,
        topk_group: need(c.topk_group, "topk_group")?,
        norm_topk_prob: need(c.norm_topk_prob, "norm_topk_prob")?,
        routed_scaling_factor: need(c.routed_scaling_factor, "routed_scaling_factor")?,
        first_k_dense_replace: need(c.first_k_dense_replace, "first_k_dense_replace")?,
        rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
        rope,
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
    };
    check_consistency(&cfg)?;
    Ok(cfg)
}

/// Plain RoPE, expressed as YaRN with factor 1 (no interpolation, unit mscale).
fn plain_rope(c: &RawConfig, rope_theta: f64) -> YarnConfig {
    YarnConfig {
        rope_theta,
        factor: 1.0,
        original_max_position_embeddings: c.max_position_embeddings.unwrap_or(4096),
        beta_fast: 32.0,
        beta_slow: 1.0,
        mscale: 1.0,
        mscale_all_dim: 0.0,
    }
}

fn check_consistency(c: &ModelConfig) -> Result<(), String> {
    if c.n_group == 0 {
        return Err("n_group must be at least 1".into());
    }
    if !c.n_routed_experts.is_multiple_of(c.n_group) {
        return Err(format!(
            "n_routed_experts {} is not a multiple of n_group {}",
            c.n_routed_experts, c.n_group
        ));
    }
    if c.topk_group > c.n_group || c.num_experts_per_tok > c.n_routed_experts {
        return Err("topk_group > n_group or num_experts_per_tok > n_routed_experts".into());
    }
    if !c.qk_rope_head_dim.is_multiple_of(2) {
        return Err(format!(
            "qk_rope_head_dim {} must be even",
            c.qk_rope_head_dim
        ));
    }
    Ok(())
}
