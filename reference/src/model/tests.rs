use super::*;
use crate::data::Rng;
use crate::gemm::gemm_nt;
use crate::norm::rmsnorm;
use crate::rope::YarnConfig;

fn tiny(q_lora_rank: Option<usize>, tie_word_embeddings: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 11,
        hidden_size: 16,
        intermediate_size: 24,
        moe_intermediate_size: 8,
        num_hidden_layers: 2,
        num_attention_heads: 3,
        q_lora_rank,
        kv_lora_rank: 10,
        qk_nope_head_dim: 6,
        qk_rope_head_dim: 4,
        v_head_dim: 5,
        n_routed_experts: 8,
        n_shared_experts: 1,
        num_experts_per_tok: 2,
        n_group: 2,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
        first_k_dense_replace: 1,
        rms_norm_eps: 1e-6,
        rope: YarnConfig {
            factor: 4.0,
            original_max_position_embeddings: 8,
            ..YarnConfig::kimi_k2()
        },
        tie_word_embeddings,
    }
}

/// Seeded weights for every tensor the model reads: norms near 1, matrices
/// ~ N(0, 1/fan_in), router biases ~ N(0, 0.05^2).
fn random_weights(cfg: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = Rng::new(seed);
    weight_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let (base, std) = match shape.as_slice() {
                [_] if name.ends_with("bias") => (0.0, 0.05),
                [_] => (1.0, 0.1),
                [_, k] => (0.0, (*k as f64).powf(-0.5)),
                _ => unreachable!(),
            };
            let data = (0..n).map(|_| (base + std * rng.normal()) as f32).collect();
            (name, Tensor::new(shape, data))
        })
        .collect()
}

const TOKENS: [u32; 9] = [3, 1, 4, 1, 5, 9, 2, 6, 5];

#[test]
fn logits_of_a_prefix_are_the_first_rows_of_the_whole() {
    for cfg in [tiny(Some(12), false), tiny(None, true)] {
        let w = random_weights(&cfg, 7);
        let whole = forward(&cfg, &w, &TOKENS);
        assert_eq!(whole.len(), TOKENS.len() * cfg.vocab_size);
        assert!(whole.iter().all(|v| v.is_finite()));
        let prefix = forward(&cfg, &w, &TOKENS[..4]);
        assert_eq!(prefix, whole[..4 * cfg.vocab_size]);
    }
}

#[test]
fn with_zero_block_outputs_logits_are_the_head_of_the_normed_embedding() {
    let cfg = tiny(Some(12), false);
    let mut w = random_weights(&cfg, 8);
    for (name, t) in w.iter_mut() {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            t.data.iter_mut().for_each(|v| *v = 0.0);
        }
    }
    let h = cfg.hidden_size;
    let table = &w["model.embed_tokens.weight"].data;
    let x: Vec<f32> = TOKENS
        .iter()
        .flat_map(|&t| table[t as usize * h..][..h].to_vec())
        .collect();
    let normed = rmsnorm(&x, &w["model.norm.weight"].data, 1e-6);
    let normed: Vec<f32> = normed.iter().map(|&v| v as f32).collect();
    let expected = gemm_nt(
        &normed,
        &w["lm_head.weight"].data,
        TOKENS.len(),
        cfg.vocab_size,
        h,
    );
    let got = forward(&cfg, &w, &TOKENS);
    for (g, e) in got.iter().zip(&expected) {
        assert!((g - e).abs() < 1e-5, "{g} vs {e}");
    }
}

#[test]
fn tied_embeddings_use_embed_tokens_as_the_head() {
    let tied = tiny(None, true);
    let w = random_weights(&tied, 9);
    assert!(!w.contains_key("lm_head.weight"));
    let mut untied_w = w.clone();
    untied_w.insert(
        "lm_head.weight".into(),
        w["model.embed_tokens.weight"].clone(),
    );
    let untied = ModelConfig {
        tie_word_embeddings: false,
        ..tied.clone()
    };
    assert_eq!(
        forward(&tied, &w, &TOKENS),
        forward(&untied, &untied_w, &TOKENS)
    );
}

#[test]
fn identical_experts_add_up_to_the_scaling_factor_times_one() {
    // Normalized combine weights sum to 1, so with every routed expert equal the routed
    // part is routed_scaling_factor * expert(x), whatever the routing.
    let cfg = tiny(Some(12), false);
    let mut w = random_weights(&cfg, 10);
    for j in 1..cfg.n_routed_experts {
        for m in ["gate", "up", "down"] {
            let first = w[&format!("model.layers.1.mlp.experts.0.{m}_proj.weight")].clone();
            w.insert(
                format!("model.layers.1.mlp.experts.{j}.{m}_proj.weight"),
                first,
            );
        }
    }
    let h = cfg.hidden_size;
    let mut rng = Rng::new(11);
    let x: Vec<f64> = (0..5 * h).map(|_| rng.normal()).collect();
    let inter = cfg.moe_intermediate_size;
    let one = mlp::swiglu(&w, "model.layers.1.mlp.experts.0.", inter, h, &x);
    let shared = mlp::swiglu(&w, "model.layers.1.mlp.shared_experts.", inter, h, &x);
    let got = mlp::moe(&cfg, &w, "model.layers.1.mlp.", &x);
    for ((g, o), s) in got.iter().zip(&one).zip(&shared) {
        let e = s + cfg.routed_scaling_factor * o;
        assert!((g - e).abs() <= 1e-12 * (1.0 + e.abs()), "{g} vs {e}");
    }
}

#[test]
fn a_single_token_attends_only_to_itself() {
    // One query over one key: softmax is exactly 1, whatever the scores, so scaling
    // the queries changes nothing for one token and something for two.
    let cfg = tiny(None, false);
    let mut w = random_weights(&cfg, 12);
    let (one, two) = (
        forward(&cfg, &w, &TOKENS[..1]),
        forward(&cfg, &w, &TOKENS[..2]),
    );
    let q = w.get_mut("model.layers.0.self_attn.q_proj.weight").unwrap();
    q.data.iter_mut().for_each(|v| *v *= 4.0);
    let scaled = forward(&cfg, &w, &TOKENS[..1]);
    for (a, b) in one.iter().zip(&scaled) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }
    let two_scaled = forward(&cfg, &w, &TOKENS[..2]);
    assert!(two
        .iter()
        .zip(&two_scaled)
        .any(|(a, b)| (a - b).abs() > 1e-6));
}

#[test]
fn hidden_states_hold_the_embeddings_and_each_layer() {
    let cfg = tiny(Some(12), false);
    let w = random_weights(&cfg, 13);
    let states = hidden_states(&cfg, &w, &TOKENS[..3]);
    assert_eq!(states.len(), cfg.num_hidden_layers + 1);
    let h = cfg.hidden_size;
    let row = &w["model.embed_tokens.weight"].data[4 * h..5 * h];
    assert!(states[0][2 * h..3 * h]
        .iter()
        .zip(row)
        .all(|(&a, &b)| a == b as f64));
    assert!(states.iter().all(|s| s.len() == 3 * h));
}

#[test]
#[should_panic(expected = "missing weight model.layers.1.mlp.gate.e_score_correction_bias")]
fn a_missing_weight_panics_with_its_name() {
    let cfg = tiny(Some(12), false);
    let mut w = random_weights(&cfg, 14);
    w.remove("model.layers.1.mlp.gate.e_score_correction_bias");
    forward(&cfg, &w, &TOKENS);
}

#[test]
#[should_panic(expected = "weight model.layers.0.self_attn.kv_b_proj.weight has shape")]
fn a_misshapen_weight_panics_with_its_name() {
    let cfg = tiny(Some(12), false);
    let mut w = random_weights(&cfg, 15);
    let t = w
        .get_mut("model.layers.0.self_attn.kv_b_proj.weight")
        .unwrap();
    t.shape.reverse();
    forward(&cfg, &w, &TOKENS);
}
