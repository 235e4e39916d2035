//! Checks that the derived bounds hold for simulated low-precision kernels, and the
//! comparison bookkeeping.

use super::*;
use crate::data::{normal_with_outliers, Rng};
use crate::formats::bf16_round;
use crate::gemm::{gemm_nt, gemm_nt_magnitude};
use crate::mla::{mla_attention, AttnBatch, PagedKv, KV_DIM, KV_LORA_RANK};

#[test]
fn unit_roundoffs_are_half_an_ulp_of_one() {
    assert_eq!(DType::F32.unit_roundoff(), f32::EPSILON as f64 / 2.0);
    assert_eq!(DType::F64.unit_roundoff(), f64::EPSILON / 2.0);
    assert_eq!(DType::BF16.unit_roundoff(), 2f64.powi(-8));
    assert_eq!(DType::E4M3.unit_roundoff(), 0.0625);
    assert_eq!(DType::E2M1.unit_roundoff(), 0.25);
    assert_eq!(gamma(4, DType::E2M1), f64::INFINITY);
    assert_eq!(gamma(1, DType::E2M1), 1.0 / 3.0);
}

/// Serial dot product with every operation rounded by `round`.
fn rounded_dot(a: &[f32], b: &[f32], round: fn(f32) -> f32) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0, |acc, (&x, &y)| round(acc + round(x * y)))
}

#[test]
fn serial_and_tree_sums_stay_within_the_dot_bound() {
    let mut rng = Rng::new(17);
    let k = 1023;
    let a = normal_with_outliers(&mut rng, 4 * k, 1.0);
    let w = normal_with_outliers(&mut rng, 3 * k, 1.0);
    let exact = gemm_nt(&a, &w, 4, 3, k);
    let mag = gemm_nt_magnitude(&a, &w, 4, 3, k);
    for (round, dtype) in [
        (bf16_round as fn(f32) -> f32, DType::BF16),
        (|x| x, DType::F32),
    ] {
        let mut actual = Vec::new();
        for i in 0..4 {
            for j in 0..3 {
                actual.push(rounded_dot(
                    &a[i * k..(i + 1) * k],
                    &w[j * k..(j + 1) * k],
                    round,
                ));
            }
        }
        let tol = Tolerance::dot(k, dtype, DType::F32);
        let c = compare(&actual, &exact, &tol.allowed_all(&exact, &mag));
        assert!(c.passed(), "{dtype:?}: {c}");
        assert!(
            c.worst_ratio < 0.5,
            "bound should not be tight on random data: {c}"
        );
    }
}

/// f32 attention for one query over `rows`, flash-style: blocks of 64 with an online
/// max and accumulator rescaling.
/// Flash attention in f32 over blocks of `block` rows, with the queries, the softmax weights
/// and the values passed through `operand` before they are multiplied (the tensor-core
/// path rounds them to bf16).
fn flash_attention_f32(
    q: &[f32],
    rows: &[&[f32]],
    scale: f32,
    block: usize,
    operand: fn(f32) -> f32,
) -> Vec<f32> {
    let q: Vec<f32> = q.iter().map(|&x| operand(x)).collect();
    let mut m = f32::NEG_INFINITY;
    let mut denom = 0.0f32;
    let mut acc = vec![0.0f32; KV_LORA_RANK];
    for block in rows.chunks(block) {
        let s: Vec<f32> = block
            .iter()
            .map(|r| {
                q.iter()
                    .zip(r.iter())
                    .map(|(a, &b)| a * operand(b))
                    .sum::<f32>()
                    * scale
            })
            .collect();
        let m_new = s.iter().fold(m, |x, &y| x.max(y));
        let alpha = (m - m_new).exp();
        denom *= alpha;
        acc.iter_mut().for_each(|x| *x *= alpha);
        for (r, &sj) in block.iter().zip(&s) {
            let e = (sj - m_new).exp();
            denom += e;
            let w = operand(e);
            acc.iter_mut()
                .zip(&r[..KV_LORA_RANK])
                .for_each(|(x, &v)| *x += w * operand(v));
        }
        m = m_new;
    }
    acc.iter().map(|x| x / denom).collect()
}

/// Emulates a flash-attention kernel (online softmax over `block`-row blocks, operands
/// through `operand`) on two query tokens and checks it against the oracle under
/// `attention_allowed` with `operands`.
fn flash_attention_within_bound(block: usize, operand: fn(f32) -> f32, operands: DType) {
    let mut rng = Rng::new(23);
    let (page_size, num_pages, kv_len) = (16, 20, 300);
    let rows = normal_with_outliers(&mut rng, page_size * num_pages * KV_DIM, 1.0);
    let kv = PagedKv {
        page_size,
        num_pages,
        rows,
    };
    let table: Vec<u32> = (0..num_pages as u32).rev().collect();
    let batch = AttnBatch {
        q_lens: vec![2],
        kv_lens: vec![kv_len],
        block_tables: vec![table],
        trees: Vec::new(),
    };
    let q = normal_with_outliers(&mut rng, 2 * KV_DIM, 0.5);
    let scale = 0.05f32;
    let oracle = mla_attention(&q, 1, &kv, &batch, scale);
    let mut actual = Vec::new();
    let mut allowed = Vec::new();
    for t in 0..2 {
        let visible = kv_len - 2 + t + 1;
        let rows: Vec<&[f32]> = (0..visible)
            .map(|p| kv.row(batch.row_of(0, p, page_size)))
            .collect();
        actual.extend(flash_attention_f32(
            &q[t * KV_DIM..(t + 1) * KV_DIM],
            &rows,
            scale,
            block,
            operand,
        ));
        let bound = attention_allowed(
            KV_DIM,
            visible,
            oracle.score_magnitude[t],
            oracle.value_magnitude[t],
            operands,
            DType::F32,
            DType::F32,
        );
        allowed.extend(std::iter::repeat_n(bound, KV_LORA_RANK));
    }
    let c = compare(&actual, &oracle.out, &allowed);
    assert!(c.passed(), "{c}");
}

#[test]
fn flash_attention_in_f32_stays_within_the_attention_bound() {
    flash_attention_within_bound(64, |x| x, DType::F32);
}

#[test]
fn flash_attention_on_bf16_operands_stays_within_the_attention_bound() {
    flash_attention_within_bound(32, bf16_round, DType::BF16);
}

#[test]
fn non_finite_values_always_fail() {
    let c = compare(&[1.0, f32::NAN, 2.0], &[1.0, 1.0, 2.0], &[1e9; 3]);
    assert!(!c.passed());
    assert_eq!((c.non_finite, c.failures, c.worst_index), (1, 0, 1));
    assert_eq!(c.worst_ratio, f64::INFINITY);
    let c = compare(&[f32::INFINITY], &[f64::INFINITY], &[1.0]);
    assert!(!c.passed());
}

#[test]
fn comparison_finds_the_worst_element_and_reports_it() {
    let c = compare(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.5], &[0.1, 1.0, 0.25]);
    assert_eq!(c.failures, 1);
    assert_eq!(c.worst_index, 2);
    assert_eq!(c.worst_ratio, 2.0);
    assert_eq!(c.max_abs_err, 0.5);
    assert_eq!(c.max_rel_err, 0.25);
    let text = c.to_string();
    assert!(
        text.contains("index 2") && text.contains("actual 3e0") && text.contains("allowed 2.5e-1"),
        "{text}"
    );
    assert!(!compare(&[], &[], &[]).passed());
    assert!(compare(&[1.0], &[1.0], &[0.0]).passed());
}

#[test]
#[should_panic(expected = "lengths differ")]
fn mismatched_lengths_panic() {
    compare(&[1.0], &[1.0, 2.0], &[0.0, 0.0]);
}

/// Gate and up sums perturbed anywhere inside their allowed errors, then SwiGLU in f32, stay
/// within `swiglu_of_sums_allowed` of the exact `silu(gate) * up`, over gates from the
/// negative tail to large positives.
#[test]
fn swiglu_of_perturbed_sums_stays_within_its_bound() {
    let mut rng = Rng::new(17);
    for i in 0..20_000 {
        let gate = (rng.uniform_f32() as f64 - 0.5) * if i % 2 == 0 { 20.0 } else { 200.0 };
        let up = (rng.uniform_f32() as f64 - 0.5) * 8.0;
        let (gate_err, up_err) = (
            rng.uniform_f32() as f64 * 1e-3 * (1.0 + gate.abs()),
            rng.uniform_f32() as f64 * 1e-3 * (1.0 + up.abs()),
        );
        let g = (gate + gate_err * (2.0 * rng.uniform_f32() as f64 - 1.0)) as f32;
        let u = (up + up_err * (2.0 * rng.uniform_f32() as f64 - 1.0)) as f32;
        let actual = g / (1.0 + (-g).exp()) * u;
        let expected = crate::activation::silu(gate) * up;
        let allowed = swiglu_of_sums_allowed(gate, up, gate_err, up_err);
        assert!(
            (actual as f64 - expected).abs() <= allowed,
            "gate {gate} up {up}: {actual} against {expected}, allowed {allowed}"
        );
    }
}
