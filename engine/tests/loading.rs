//! Loading real safetensors checkpoints in every supported weight format, and the typed
//! errors that bad files, bad configs and missing or mismatched tensors produce.
mod common;

use common::{quant_fragment, tiny_tensors, write_checkpoint, ExpertFormat, TINY_CONFIG};
use kiln::model::weights::{needed_tensors, LoadedWeight};
use kiln::model::{Checkpoint, LoadError, ModelSpec, QuantMethod};
use kiln_reference::formats::{e2m1_decode, e4m3_decode};
use safetensors::Dtype;

const EXPERT: &str = "model.layers.1.mlp.experts.2.down_proj.weight";

fn checkpoint(format: ExpertFormat) -> (tempfile::TempDir, Checkpoint) {
    let dir = tempfile::tempdir().unwrap();
    let (tensors, _) = tiny_tensors(format, 1);
    write_checkpoint(dir.path(), quant_fragment(format), &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    (dir, ckpt)
}

#[test]
fn bf16_checkpoints_load_every_tensor_exactly() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::Bf16);
    let (tensors, _) = tiny_tensors(ExpertFormat::Bf16, 1);
    let weights = ckpt.reference_weights().unwrap();
    assert_eq!(weights.len(), needed_tensors(&ckpt.spec.arch).len());
    for (name, (_, shape, bytes)) in &tensors {
        let loaded = &weights[name];
        assert_eq!(&loaded.shape, shape, "{name}");
        let first = f32::from_bits((u16::from_le_bytes([bytes[0], bytes[1]]) as u32) << 16);
        assert_eq!(loaded.data[0], first, "{name}");
    }
}

#[test]
fn modelopt_nvfp4_experts_load_as_their_codes_and_scales() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::ModelOptNvfp4);
    assert_eq!(ckpt.spec.quant, QuantMethod::ModelOptNvfp4);
    let (tensors, _) = tiny_tensors(ExpertFormat::ModelOptNvfp4, 1);
    let LoadedWeight::Nvfp4(m) = ckpt.linear(EXPERT, [32, 32]).unwrap() else {
        panic!("experts should load as NVFP4");
    };
    let prefix = EXPERT.strip_suffix(".weight").unwrap();
    assert_eq!(m.packed, tensors[EXPERT].2);
    assert_eq!(m.scales, tensors[&format!("{prefix}.weight_scale")].2);
    let w = m.dequantize();
    let expect = e2m1_decode(m.packed[0] & 0xf) * e4m3_decode(m.scales[0]) * m.global_scale;
    assert_eq!(w[0], expect);
}

#[test]
fn compressed_tensors_nvfp4_uses_the_reciprocal_global_scale() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::CompressedNvfp4);
    let (_dir2, modelopt) = checkpoint(ExpertFormat::ModelOptNvfp4);
    let ct = ckpt.linear(EXPERT, [32, 32]).unwrap().dequantize();
    let mo = modelopt.linear(EXPERT, [32, 32]).unwrap().dequantize();
    for (a, b) in ct.data.iter().zip(&mo.data) {
        // g -> 1/g -> 1/(1/g) may move the global scale by an ulp or two.
        assert!((a - b).abs() <= 4.0 * f32::EPSILON * b.abs(), "{a} vs {b}");
    }
}

/// Kimi's INT4 release converted to NVFP4: measured relative RMS error against the INT4
/// values themselves (not exact: ±5, ±7 and -8 are not E2M1 values).
#[test]
fn int4_experts_convert_to_nvfp4_with_bounded_error() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::CompressedInt4);
    let dir = tempfile::tempdir().unwrap();
    let (tensors, _) = tiny_tensors(ExpertFormat::CompressedInt4, 1);
    write_checkpoint(
        dir.path(),
        quant_fragment(ExpertFormat::CompressedInt4),
        &tensors,
    );
    let prefix = EXPERT.strip_suffix(".weight").unwrap();
    let packed = &tensors[&format!("{prefix}.weight_packed")].2;
    let scales = &tensors[&format!("{prefix}.weight_scale")].2;
    let int4: Vec<f32> = packed
        .chunks(4)
        .flat_map(|c| {
            let word = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            (0..8).map(move |j| ((word >> (4 * j)) & 0xf) as f32 - 8.0)
        })
        .enumerate()
        .map(|(i, q)| {
            let s = &scales[(i / 32) * 2..(i / 32) * 2 + 2];
            q * f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16)
        })
        .collect();
    let LoadedWeight::Nvfp4(m) = ckpt.linear(EXPERT, [32, 32]).unwrap() else {
        panic!("INT4 experts should convert to NVFP4");
    };
    let nvfp4 = m.dequantize();
    let err: f64 = int4
        .iter()
        .zip(&nvfp4)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = int4.iter().map(|a| (*a as f64).powi(2)).sum();
    let rel_rms = (err / norm).sqrt();
    eprintln!("INT4 -> NVFP4 relative RMS error: {rel_rms:.4}");
    assert!(rel_rms < 0.12, "conversion error {rel_rms}");
}

/// DeepSeek-V3's FP8: dense projections dequantize block by block, exactly
/// `e4m3(code) * scale_inv[block]` (ragged last blocks included); the config names the
/// block shape.
#[test]
fn fp8_block_scaled_weights_dequantize_block_by_block() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::Fp8Block);
    assert_eq!(ckpt.spec.quant, QuantMethod::Fp8Block { block: [16, 16] });
    let (tensors, _) = tiny_tensors(ExpertFormat::Fp8Block, 1);
    let name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight";
    let (out, inp) = (20, 32);
    let LoadedWeight::Dense(w) = ckpt.linear(name, [out, inp]).unwrap() else {
        panic!("dense FP8 layers load as their values");
    };
    let codes = &tensors[name].2;
    let scales: Vec<f32> =
        (tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].2)
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
    assert_eq!(scales.len(), 2 * 2, "20 rows make a ragged second block");
    for (k, &v) in w.data.iter().enumerate() {
        let (i, j) = (k / inp, k % inp);
        assert_eq!(
            v,
            e4m3_decode(codes[k]) * scales[(i / 16) * 2 + j / 16],
            "({i}, {j})"
        );
    }
    // Every tensor the architecture needs loads (the router and lm_head stay bf16).
    assert_eq!(
        ckpt.reference_weights().unwrap().len(),
        needed_tensors(&ckpt.spec.arch).len()
    );
}

/// FP8 routed experts converted to NVFP4 at load: measured relative RMS error against the
/// FP8 values.
#[test]
fn fp8_experts_convert_to_nvfp4_with_bounded_error() {
    let (_dir, ckpt) = checkpoint(ExpertFormat::Fp8Block);
    let (tensors, _) = tiny_tensors(ExpertFormat::Fp8Block, 1);
    let prefix = EXPERT.strip_suffix(".weight").unwrap();
    let scales: Vec<f32> = (tensors[&format!("{prefix}.weight_scale_inv")].2)
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let fp8: Vec<f32> = (tensors[EXPERT].2.iter().enumerate())
        .map(|(k, &c)| e4m3_decode(c) * scales[(k / 32 / 16) * 2 + (k % 32) / 16])
        .collect();
    let LoadedWeight::Nvfp4(m) = ckpt.linear(EXPERT, [32, 32]).unwrap() else {
        panic!("FP8 experts should convert to NVFP4");
    };
    let nvfp4 = m.dequantize();
    let err: f64 = (fp8.iter().zip(&nvfp4))
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let norm: f64 = fp8.iter().map(|a| (*a as f64).powi(2)).sum();
    let rel_rms = (err / norm).sqrt();
    eprintln!("FP8 -> NVFP4 relative RMS error: {rel_rms:.4}");
    assert!(rel_rms < 0.12, "conversion error {rel_rms}");
}

/// Block scales in a checkpoint whose config does not say fp8, an FP8 config with a block
/// shape of the wrong length, and a scale tensor of the wrong shape are errors that say so.
#[test]
fn bad_fp8_checkpoints_name_the_problem() {
    let (tensors, _) = tiny_tensors(ExpertFormat::Fp8Block, 1);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), "", &tensors);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let err = ckpt.linear(EXPERT, [32, 32]).unwrap_err().to_string();
    assert!(err.contains("not fp8"), "{err}");

    let bad_block = TINY_CONFIG.replace(
        "QUANT",
        r#", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}"#,
    );
    let err = ModelSpec::from_json(&bad_block).unwrap_err();
    assert!(err.contains("weight_block_size"), "{err}");

    let mut tensors = tensors;
    let key = format!(
        "{}.weight_scale_inv",
        EXPERT.strip_suffix(".weight").unwrap()
    );
    tensors.get_mut(&key).unwrap().1 = vec![4, 1];
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), quant_fragment(ExpertFormat::Fp8Block), &tensors);
    let err = Checkpoint::open(dir.path())
        .and_then(|c| c.linear(EXPERT, [32, 32]))
        .unwrap_err();
    assert!(matches!(err, LoadError::Shape { .. }), "{err}");
}

#[test]
fn a_truncated_file_is_a_corrupt_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (tensors, _) = tiny_tensors(ExpertFormat::Bf16, 2);
    write_checkpoint(dir.path(), "", &tensors);
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    match Checkpoint::open(dir.path()) {
        Err(LoadError::Corrupt { path: p, .. }) => assert_eq!(p, path),
        other => panic!("expected Corrupt, got {:?}", other.err()),
    }
    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()),
        Err(LoadError::Corrupt { .. })
    ));
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (mut tensors, _) = tiny_tensors(ExpertFormat::Bf16, 3);
    tensors.remove("model.layers.1.mlp.gate.e_score_correction_bias");
    write_checkpoint(dir.path(), "", &tensors);
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .reference_weights()
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("model.layers.1.mlp.gate.e_score_correction_bias"),
        "{err}"
    );
}

#[test]
fn dtype_and_shape_disagreements_name_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (mut tensors, _) = tiny_tensors(ExpertFormat::Bf16, 4);
    let norm = "model.norm.weight".to_string();
    tensors.insert(norm.clone(), (Dtype::I32, vec![8], vec![0; 32]));
    write_checkpoint(dir.path(), "", &tensors);
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .reference_weights()
        .unwrap_err();
    assert!(
        matches!(&err, LoadError::Shape { tensor, .. } if *tensor == norm),
        "{err}"
    );

    tensors.insert(norm.clone(), (Dtype::I32, vec![32], vec![0; 128]));
    write_checkpoint(dir.path(), "", &tensors);
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .reference_weights()
        .unwrap_err();
    assert!(
        matches!(&err, LoadError::Dtype { tensor, .. } if *tensor == norm),
        "{err}"
    );
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn a_directory_without_weights_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        TINY_CONFIG.replace("QUANT", ""),
    )
    .unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()),
        Err(LoadError::NoWeights { .. })
    ));
}

#[test]
fn bad_configs_name_the_problem() {
    let unknown = TINY_CONFIG
        .replace("\"deepseek_v3\"", "\"llama\"")
        .replace("QUANT", "");
    assert!(ModelSpec::from_json(&unknown)
        .unwrap_err()
        .contains("llama"));
    let missing = TINY_CONFIG
        .replace("\"kv_lora_rank\": 16,", "")
        .replace("QUANT", "");
    assert!(ModelSpec::from_json(&missing)
        .unwrap_err()
        .contains("kv_lora_rank"));
    assert!(ModelSpec::from_json("{ not json").is_err());
}

/// `rope_parameters` as transformers 5.25's `save_pretrained` writes it for a config made
/// with a transformers 4 style `rope_scaling` (`type`): both spellings of the kind.
const ROPE_AS_TRANSFORMERS_5_WRITES_IT: &str = r#""rope_parameters": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 50000.0, "rope_type": "yarn", "type": "yarn"},"#;

#[test]
fn rope_kinds_are_read_in_every_spelling_transformers_writes() {
    let config = |rope: &str| {
        TINY_CONFIG
            .replace("\"rope_theta\": 10000.0,", rope)
            .replace("QUANT", "")
    };
    let both = ModelSpec::from_json(&config(ROPE_AS_TRANSFORMERS_5_WRITES_IT)).unwrap();
    assert_eq!(both.arch.rope.factor, 32.0);
    assert_eq!(both.arch.rope.rope_theta, 50000.0);
    assert_eq!(both.arch.rope.original_max_position_embeddings, 4096);
    for one in [r#""type": "yarn","#, r#""rope_type": "yarn","#] {
        let rope = ROPE_AS_TRANSFORMERS_5_WRITES_IT
            .replace(r#", "rope_type": "yarn", "type": "yarn""#, "")
            .replace(r#""beta_fast""#, &format!(r#"{one} "beta_fast""#));
        let spec = ModelSpec::from_json(&config(&rope)).unwrap();
        assert_eq!(spec.arch.rope, both.arch.rope, "{one}");
    }
    let clash =
        ROPE_AS_TRANSFORMERS_5_WRITES_IT.replace(r#""type": "yarn""#, r#""type": "linear""#);
    let err = ModelSpec::from_json(&config(&clash)).unwrap_err();
    assert!(
        err.contains("rope_type \"yarn\" and type \"linear\""),
        "{err}"
    );
}

#[test]
fn kimi_k25_reads_the_nested_text_config() {
    let inner = TINY_CONFIG
        .replace("\"deepseek_v3\"", "\"kimi_k2\"")
        .replace("QUANT", "");
    let outer = format!(
        r#"{{"model_type": "kimi_k25", "text_config": {inner}, "quantization_config": {{"quant_method": "compressed-tensors", "format": "pack-quantized"}}}}"#
    );
    let spec = ModelSpec::from_json(&outer).unwrap();
    assert_eq!(spec.model_type, "kimi_k25");
    assert_eq!(spec.arch.kv_lora_rank, 16);
    assert_eq!(
        spec.quant,
        QuantMethod::CompressedTensors("pack-quantized".into())
    );
}

#[test]
fn the_tokenizer_and_chat_template_come_from_the_directory() {
    use kiln::model::tokenizer::TextCodec;
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tiny-kimi");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture.join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let template = "{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}";
    let config = serde_json::json!({ "chat_template": template });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let codec = TextCodec::from_dir(dir.path()).unwrap();
    assert_eq!(codec.chat_template.as_deref(), Some(template));
    let ids = codec.encode("kiln serves coding agents").unwrap();
    assert_eq!(codec.decode(&ids).unwrap(), "kiln serves coding agents");
    std::fs::remove_file(dir.path().join("tokenizer.json")).unwrap();
    let err = TextCodec::from_dir(dir.path())
        .err()
        .expect("no tokenizer.json");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}
