//! Writes small but complete DeepSeek-V3 checkpoints in each weight format the loader takes,
//! so loading tests run on real safetensors files made by the tests themselves.
#![allow(dead_code)]
use std::collections::BTreeMap;
use std::path::Path;

use kiln::model::weights::{needed_tensors, Role};
use kiln::model::ModelSpec;
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{bf16_decode, bf16_encode, e4m3_encode};
use kiln_reference::nvfp4::Nvfp4Matrix;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// How the routed experts are stored (`Fp8Block`: every projection but the router and
/// lm_head, as DeepSeek-V3 ships).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    Bf16,
    ModelOptNvfp4,
    CompressedNvfp4,
    CompressedInt4,
    Fp8Block,
}

/// The FP8 tests' `weight_block_size`: small, so the tiny shapes have several blocks and
/// ragged ones (20 rows of `kv_a_proj_with_mqa`).
pub const FP8_BLOCK: usize = 16;

/// DeepSeek-V3's block-scaled FP8 of `w` `[out, in]`: e4m3 codes and one f32 `scale_inv`
/// per `FP8_BLOCK` square (`amax / 448`), multiplied in to dequantize.
pub fn fp8_block_quantize(w: &[f32], out: usize, inp: usize) -> (Vec<u8>, Vec<f32>) {
    let (rows, cols) = (out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK));
    let mut scales = vec![0f32; rows * cols];
    for (k, v) in w.iter().enumerate() {
        let b = (k / inp / FP8_BLOCK) * cols + (k % inp) / FP8_BLOCK;
        scales[b] = scales[b].max(v.abs() / 448.0);
    }
    scales
        .iter_mut()
        .filter(|s| **s == 0.0)
        .for_each(|s| *s = 1.0);
    let codes = (w.iter().enumerate())
        .map(|(k, v)| {
            let b = (k / inp / FP8_BLOCK) * cols + (k % inp) / FP8_BLOCK;
            e4m3_encode(v / scales[b])
        })
        .collect();
    (codes, scales)
}

pub const TINY_CONFIG: &str = r#"{
  "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
  "q_lora_rank": null, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
  "v_head_dim": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
  "n_group": 2, "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "max_position_embeddings": 128, "tie_word_embeddings": false QUANT
}"#;

/// Tensors as (dtype, shape, bytes) by name.
pub type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn bf16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| bf16_encode(v).to_le_bytes())
        .collect()
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// bf16-representable random values.
pub fn bf16_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    normal_with_outliers(rng, n, 0.1)
        .into_iter()
        .map(|v| bf16_decode(bf16_encode(v)))
        .collect()
}

/// The tensors of [`TINY_CONFIG`] with experts in `format`; also returns the f32 values each
/// expert weight was made from (before any quantization).
pub fn tiny_tensors(format: ExpertFormat, seed: u64) -> (Tensors, BTreeMap<String, Vec<f32>>) {
    let spec = ModelSpec::from_json(&TINY_CONFIG.replace("QUANT", "")).unwrap();
    spec_tensors(&spec, format, seed)
}

/// [`tiny_tensors`] for the architecture of any `spec`.
pub fn spec_tensors(
    spec: &ModelSpec,
    format: ExpertFormat,
    seed: u64,
) -> (Tensors, BTreeMap<String, Vec<f32>>) {
    let mut rng = Rng::new(seed);
    let mut tensors = Tensors::new();
    let mut originals = BTreeMap::new();
    for n in needed_tensors(&spec.arch) {
        let count: usize = n.shape.iter().product();
        let values = bf16_values(&mut rng, count);
        let prefix = n
            .name
            .strip_suffix(".weight")
            .unwrap_or(&n.name)
            .to_string();
        let expert = n.role == Role::Linear && n.name.contains(".experts.");
        let fp8 = format == ExpertFormat::Fp8Block
            && n.role == Role::Linear
            && !n.name.ends_with("mlp.gate.weight")
            && n.name != "lm_head.weight";
        if fp8 {
            let (out, inp) = (n.shape[0], n.shape[1]);
            originals.insert(n.name.clone(), values.clone());
            let (codes, scales) = fp8_block_quantize(&values, out, inp);
            tensors.insert(n.name.clone(), (Dtype::F8_E4M3, n.shape.clone(), codes));
            let blocks = vec![out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK)];
            tensors.insert(
                format!("{prefix}.weight_scale_inv"),
                (Dtype::F32, blocks, f32_bytes(&scales)),
            );
            continue;
        }
        if !expert || matches!(format, ExpertFormat::Bf16 | ExpertFormat::Fp8Block) {
            tensors.insert(
                n.name.clone(),
                (Dtype::BF16, n.shape.clone(), bf16_bytes(&values)),
            );
            continue;
        }
        let (out, inp) = (n.shape[0], n.shape[1]);
        originals.insert(n.name.clone(), values.clone());
        match format {
            ExpertFormat::ModelOptNvfp4 | ExpertFormat::CompressedNvfp4 => {
                let m = Nvfp4Matrix::quantize(&values, out, inp).unwrap();
                let modelopt = format == ExpertFormat::ModelOptNvfp4;
                let codes = if modelopt { "weight" } else { "weight_packed" };
                tensors.insert(
                    format!("{prefix}.{codes}"),
                    (Dtype::U8, vec![out, inp / 2], m.packed.clone()),
                );
                tensors.insert(
                    format!("{prefix}.weight_scale"),
                    (Dtype::F8_E4M3, vec![out, inp / 16], m.scales.clone()),
                );
                let (name, g) = if modelopt {
                    ("weight_scale_2", m.global_scale)
                } else {
                    ("weight_global_scale", 1.0 / m.global_scale)
                };
                tensors.insert(
                    format!("{prefix}.{name}"),
                    (Dtype::F32, vec![], f32_bytes(&[g])),
                );
            }
            ExpertFormat::CompressedInt4 => {
                let (packed, scales) = int4_pack(&values, out, inp);
                tensors.insert(
                    format!("{prefix}.weight_packed"),
                    (Dtype::I32, vec![out, inp / 8], packed),
                );
                tensors.insert(
                    format!("{prefix}.weight_scale"),
                    (Dtype::BF16, vec![out, inp / 32], bf16_bytes(&scales)),
                );
            }
            ExpertFormat::Bf16 | ExpertFormat::Fp8Block => unreachable!(),
        }
    }
    (tensors, originals)
}

/// Symmetric INT4, group 32, bf16 scales, stored as q + 8, 8 per little-endian i32.
pub fn int4_pack(w: &[f32], out: usize, inp: usize) -> (Vec<u8>, Vec<f32>) {
    let mut scales = Vec::with_capacity(out * inp / 32);
    let mut codes = Vec::with_capacity(out * inp);
    for group in w.chunks(32) {
        let amax = group.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = bf16_decode(bf16_encode(if amax > 0.0 { amax / 7.0 } else { 1.0 }));
        scales.push(scale);
        codes.extend(
            group
                .iter()
                .map(|v| ((v / scale).round().clamp(-8.0, 7.0) as i32 + 8) as u32),
        );
    }
    let packed = codes
        .chunks(8)
        .flat_map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |acc, (j, &q)| acc | (q << (4 * j)))
                .to_le_bytes()
        })
        .collect();
    (packed, scales)
}

/// Writes `config.json` (with `quant` spliced into the tiny config) and `model.safetensors`.
pub fn write_checkpoint(dir: &Path, quant: &str, tensors: &Tensors) {
    write_checkpoint_with_config(dir, &TINY_CONFIG.replace("QUANT", quant), tensors);
}

/// Writes `config` as `config.json` and `tensors` as `model.safetensors`.
pub fn write_checkpoint_with_config(dir: &Path, config: &str, tensors: &Tensors) {
    std::fs::write(dir.join("config.json"), config).unwrap();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The `quantization_config` fragment of each format.
pub fn quant_fragment(format: ExpertFormat) -> &'static str {
    match format {
        ExpertFormat::Bf16 => "",
        ExpertFormat::ModelOptNvfp4 => {
            r#", "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}"#
        }
        ExpertFormat::CompressedNvfp4 => {
            r#", "quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}"#
        }
        ExpertFormat::CompressedInt4 => {
            r#", "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized"}"#
        }
        ExpertFormat::Fp8Block => {
            r#", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}"#
        }
    }
}
