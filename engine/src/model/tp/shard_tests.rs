//! Slicing: the N slices of every weight reassemble to the original, NVFP4 slices keep
//! their scales, K slices off the scale blocks are refused, and the per-tensor split and
//! the rank's architecture follow the Megatron layout of [`super::super`].
use std::path::Path;

use kiln_core::model::Tensor;
use kiln_core::nvfp4::Nvfp4Matrix;
use kiln_reference::data::{normal_with_outliers, Rng};

use super::*;
use crate::model::ModelSpec;

const ROWS: usize = 6;
const COLS: usize = 64;

fn dense(seed: u64) -> LoadedWeight {
    let data = normal_with_outliers(&mut Rng::new(seed), ROWS * COLS, 1.0);
    LoadedWeight::Dense(Tensor::new(vec![ROWS, COLS], data))
}

fn nvfp4(seed: u64) -> LoadedWeight {
    let data = normal_with_outliers(&mut Rng::new(seed), ROWS * COLS, 1.0);
    LoadedWeight::Nvfp4(Nvfp4Matrix::quantize(&data, ROWS, COLS).unwrap())
}

/// The dequantized values, row-major, and the shape.
fn values(w: &LoadedWeight) -> (Vec<f32>, Vec<usize>) {
    let t = w.dequantize();
    (t.data, t.shape)
}

/// Concatenates the rows of `parts`, or the columns when `by_cols`.
fn reassemble(parts: &[LoadedWeight], by_cols: bool) -> Vec<f32> {
    let vals: Vec<(Vec<f32>, Vec<usize>)> = parts.iter().map(values).collect();
    if !by_cols {
        return vals.into_iter().flat_map(|(v, _)| v).collect();
    }
    (0..ROWS)
        .flat_map(|r| {
            vals.iter()
                .flat_map(move |(v, s)| v[r * s[1]..(r + 1) * s[1]].to_vec())
        })
        .collect()
}

#[test]
fn row_slices_reassemble_the_original_weight() {
    for w in [dense(1), nvfp4(2)] {
        for ranks in [1, 2, 3, 6] {
            let parts: Vec<_> = (0..ranks)
                .map(|r| slice(&w, Split::Rows, r, ranks).unwrap())
                .collect();
            assert_eq!(reassemble(&parts, false), values(&w).0, "{ranks} ranks");
        }
    }
}

#[test]
fn column_slices_reassemble_the_original_weight() {
    for w in [dense(3), nvfp4(4)] {
        for ranks in [1, 2, 4] {
            let parts: Vec<_> = (0..ranks)
                .map(|r| slice(&w, Split::Cols, r, ranks).unwrap())
                .collect();
            assert_eq!(reassemble(&parts, true), values(&w).0, "{ranks} ranks");
        }
    }
}

#[test]
fn nvfp4_slices_keep_their_codes_block_scales_and_global_scale() {
    let LoadedWeight::Nvfp4(m) = nvfp4(5) else {
        unreachable!()
    };
    let w = LoadedWeight::Nvfp4(m.clone());
    let (LoadedWeight::Nvfp4(rows), LoadedWeight::Nvfp4(cols)) = (
        slice_rows(&w, 2..5).unwrap(),
        slice_cols(&w, 16..48).unwrap(),
    ) else {
        panic!("NVFP4 slices must stay NVFP4");
    };
    assert_eq!((rows.rows, rows.cols, cols.rows, cols.cols), (3, 64, 6, 32));
    assert_eq!(rows.global_scale, m.global_scale);
    assert_eq!(cols.global_scale, m.global_scale);
    for r in 0..3 {
        for c in 0..64 {
            assert_eq!(rows.code(r, c), m.code(r + 2, c));
            assert_eq!(rows.scale_code(r, c), m.scale_code(r + 2, c));
        }
    }
    for r in 0..6 {
        for c in 0..32 {
            assert_eq!(cols.code(r, c), m.code(r, c + 16));
            assert_eq!(cols.scale_code(r, c), m.scale_code(r, c + 16));
        }
    }
}

#[test]
fn nvfp4_column_slices_off_the_scale_blocks_are_refused() {
    let w = nvfp4(6);
    assert_eq!(
        slice_cols(&w, 8..24).unwrap_err(),
        SliceError::UnalignedNvfp4 { start: 8, end: 24 }
    );
    // 64 columns over 8 ranks: 8 per rank, half a scale block.
    assert_eq!(
        slice(&w, Split::Cols, 1, 8).unwrap_err(),
        SliceError::UnalignedNvfp4 { start: 8, end: 16 }
    );
    // Dense weights have no blocks.
    assert!(slice(&dense(6), Split::Cols, 1, 8).is_ok());
}

#[test]
fn slices_outside_the_weight_or_uneven_are_refused() {
    let w = dense(7);
    assert!(matches!(
        slice_rows(&w, 4..7),
        Err(SliceError::OutOfRange { axis: "rows", .. })
    ));
    assert_eq!(
        slice(&w, Split::Rows, 0, 4).unwrap_err(),
        SliceError::Uneven {
            axis: "rows",
            len: 6,
            ranks: 4
        }
    );
    let norm = LoadedWeight::Dense(Tensor::new(vec![4], vec![1.0; 4]));
    assert!(matches!(
        slice(&norm, Split::Rows, 0, 2),
        Err(SliceError::NotMatrix { .. })
    ));
    assert!(slice(&norm, Split::Replicated, 0, 2).is_ok());
}

#[test]
fn vocab_slices_end_in_a_zero_padding_row() {
    for w in [dense(8), nvfp4(9)] {
        let parts: Vec<_> = (0..3)
            .map(|r| slice(&w, Split::Vocab, r, 3).unwrap())
            .collect();
        let mut rows = Vec::new();
        for p in &parts {
            let (v, shape) = values(p);
            assert_eq!(shape, vec![3, COLS]);
            assert!(v[2 * COLS..].iter().all(|&x| x == 0.0));
            rows.extend_from_slice(&v[..2 * COLS]);
        }
        assert_eq!(rows, values(&w).0);
    }
}

#[test]
fn tensors_split_as_megatron_lays_out_attention_and_ffn() {
    let layer = |s: &str| format!("model.layers.3.{s}.weight");
    for (name, split) in [
        ("model.embed_tokens.weight".to_string(), Split::Vocab),
        ("lm_head.weight".to_string(), Split::Vocab),
        ("model.norm.weight".to_string(), Split::Replicated),
        (layer("input_layernorm"), Split::Replicated),
        (layer("self_attn.q_a_proj"), Split::Replicated),
        (layer("self_attn.q_b_proj"), Split::Rows),
        (layer("self_attn.q_proj"), Split::Rows),
        (layer("self_attn.kv_a_proj_with_mqa"), Split::Replicated),
        (layer("self_attn.kv_a_layernorm"), Split::Replicated),
        (layer("self_attn.kv_b_proj"), Split::Rows),
        (layer("self_attn.o_proj"), Split::Cols),
        (layer("mlp.gate"), Split::Replicated),
        (
            "model.layers.3.mlp.gate.e_score_correction_bias".to_string(),
            Split::Replicated,
        ),
        (layer("mlp.gate_proj"), Split::Rows),
        (layer("mlp.down_proj"), Split::Cols),
        (layer("mlp.experts.7.gate_proj"), Split::Rows),
        (layer("mlp.experts.7.up_proj"), Split::Rows),
        (layer("mlp.experts.7.down_proj"), Split::Cols),
        (layer("mlp.shared_experts.down_proj"), Split::Cols),
    ] {
        assert_eq!(Split::of(&name), split, "{name}");
    }
}

fn tiny_kimi() -> ModelConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tiny-kimi");
    ModelSpec::from_dir(&dir).unwrap().arch
}

#[test]
fn a_rank_computes_its_share_of_heads_widths_and_vocabulary() {
    let c = tiny_kimi();
    let r = rank_config(&c, 2).unwrap();
    assert_eq!(r.num_attention_heads, c.num_attention_heads / 2);
    assert_eq!(r.intermediate_size, c.intermediate_size / 2);
    assert_eq!(r.moe_intermediate_size, c.moe_intermediate_size / 2);
    assert_eq!(r.vocab_size, c.vocab_size / 2 + 1);
    assert_eq!(r.q_lora_rank, c.q_lora_rank);
    assert_eq!(r.kv_lora_rank, c.kv_lora_rank);
    assert_eq!(r.n_routed_experts, c.n_routed_experts);
}

#[test]
fn heads_that_do_not_split_evenly_are_refused() {
    let err = rank_config(&tiny_kimi(), 4).unwrap_err();
    assert!(
        matches!(
            err,
            TpError::Indivisible {
                what: "num_attention_heads",
                value: 2,
                ranks: 4
            }
        ),
        "{err}"
    );
}
