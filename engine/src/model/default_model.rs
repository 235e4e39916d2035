//! kiln's tiny random model (`--model kiln-tiny-random`): a DeepSeek-V3 /
//! Kimi-K2-architecture model small enough to load in milliseconds, for tests of the engine
//! and the server. Its weights are generated deterministically (seeded, bf16, scaled so each
//! layer keeps its input's variance and the logits spread out, so greedy decoding has no
//! near-ties); its tokenizer (engine/assets/default-model/tokenizer.json, made by
//! tools/tiny_tokenizer.py --kimi-chat) has 512 tokens including Kimi's chat tokens. Its
//! outputs mean nothing; its shapes and formats are the real model's, MLA dims included.
use std::path::{Path, PathBuf};

use kiln_core::formats::bf16_encode;
use kiln_core::rng::Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::tokenizer::TextCodec;
use super::weights::needed_tensors;
use super::ModelSpec;

/// The name the tiny random model is served under.
pub const NAME: &str = "kiln-tiny-random";

const TOKENIZER: &str = include_str!("../../assets/default-model/tokenizer.json");

/// `config.json` of the tiny random model (kv_lora_rank 512 / rope 64: the MLA kernels' dims).
pub const CONFIG: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
  "vocab_size": 512, "hidden_size": 128, "intermediate_size": 192,
  "moe_intermediate_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 1,
  "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 96,
  "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
  "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
  "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.827,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": false,
  "bos_token_id": 0, "eos_token_id": [1, 2],
  "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
  "rope_theta": 50000.0
}"#;

/// The tiny random model's tokenizer.
pub fn codec() -> TextCodec {
    let tokenizer = TextCodec::parse(TOKENIZER).expect("the embedded tokenizer parses");
    TextCodec::from_tokenizer(tokenizer, None)
}

/// Writes the tiny random model (config.json, model.safetensors, tokenizer.json) into `dir`.
pub fn write(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), CONFIG)?;
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER)?;
    let spec = ModelSpec::from_json(CONFIG).expect("the embedded config parses");
    let cfg = &spec.arch;
    let mut rng = Rng::new(0x6b69_6c6e);
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = needed_tensors(cfg)
        .into_iter()
        .map(|t| {
            let (name, shape) = (t.name, t.shape);
            let values = init(&name, &shape, cfg.hidden_size, &mut rng);
            let bytes = values
                .iter()
                .flat_map(|&v| bf16_encode(v).to_le_bytes())
                .collect();
            (name, shape, bytes)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, bytes)| {
        let view = TensorView::new(Dtype::BF16, shape.clone(), bytes).expect("sizes match");
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(std::io::Error::other)
}

/// Initial values of one tensor: norms 1, the router bias 0, the embedding N(0, 1),
/// projections N(0, 1/k) (variance-preserving), lm_head 4x that so logits spread.
fn init(name: &str, shape: &[usize], hidden: usize, rng: &mut Rng) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let (mean, std) = if name.ends_with("norm.weight") || name.ends_with("layernorm.weight") {
        (1.0, 0.0)
    } else if name.ends_with("e_score_correction_bias") {
        (0.0, 0.0)
    } else if name == "model.embed_tokens.weight" {
        (0.0, 1.0)
    } else if name == "lm_head.weight" {
        (0.0, 4.0 / (hidden as f64).sqrt())
    } else {
        (0.0, 1.0 / (shape[shape.len() - 1] as f64).sqrt())
    };
    (0..n).map(|_| (mean + std * rng.normal()) as f32).collect()
}

/// A fresh directory holding the tiny random model, under the system's temp directory.
pub fn materialize() -> std::io::Result<PathBuf> {
    let dir = fresh_dir(NAME)?;
    write(&dir)?;
    Ok(dir)
}

/// A new empty directory for a model named `name`, under the system's temp directory.
pub fn fresh_dir(name: &str) -> std::io::Result<PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tokenizer_covers_the_model_vocabulary_and_the_chat_tokens() {
        let spec = ModelSpec::from_json(CONFIG).unwrap();
        let c = codec();
        assert_eq!(c.vocab_size(), spec.arch.vocab_size);
        assert_eq!(c.token_id("<|im_end|>"), Some(2));
        assert_eq!(spec.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn the_tiny_random_model_loads_as_a_checkpoint_and_is_the_same_every_time() {
        let (a, b) = (materialize().unwrap(), materialize().unwrap());
        let ckpt = crate::model::Checkpoint::open(&a).unwrap();
        assert_eq!(ckpt.spec.context_len, 4096);
        let read = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert!(
            read(&a) == read(&b),
            "weights are generated deterministically"
        );
        std::fs::remove_dir_all(a).unwrap();
        std::fs::remove_dir_all(b).unwrap();
    }
}
