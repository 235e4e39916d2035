//! Property tests over odd shapes and seeded data: quantization error bounds, exact
//! round trips, grouped-vs-dense GEMM, RoPE relativity, attention and router
//! invariants.

use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{e2m1_decode, e4m3_decode};
use kiln_reference::gemm::{
    gemm_nt, gemm_nt_magnitude, grouped_gemm_nt, grouped_gemm_nt_magnitude,
};
use kiln_reference::mla::{mla_attention, AttnBatch, PagedKv, KV_DIM, KV_LORA_RANK};
use kiln_reference::moe_gate::{route, GateConfig};
use kiln_reference::norm::rmsnorm;
use kiln_reference::nvfp4::{quantize_experts, Nvfp4Matrix, BLOCK};
use kiln_reference::rope::{apply_interleaved, YarnConfig};
use kiln_reference::softmax::softmax;
use kiln_reference::tree::{tree_mask, Tree};
use proptest::prelude::*;

/// Half the gap around an E2M1 magnitude, the largest rounding error (in units of
/// the block scale) of a value that decoded to it; at 6 it also covers saturation of
/// values up to 6.4 (an E4M3 block scale rounded down by at most 1/16).
fn e2m1_half_gap(mag: f32) -> f64 {
    match mag {
        m if m < 2.0 => 0.25,
        m if m < 4.0 => 0.5,
        _ => 1.0,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn nvfp4_error_is_at_most_half_an_e2m1_step(
        rows in 1usize..7, blocks in 1usize..5, seed in any::<u64>(), scale in 1e-3f32..1e3,
    ) {
        let cols = blocks * BLOCK;
        let mut rng = Rng::new(seed);
        let w = normal_with_outliers(&mut rng, rows * cols, scale);
        let q = Nvfp4Matrix::quantize(&w, rows, cols).unwrap();
        prop_assert_eq!(q.packed.len(), rows * cols / 2);
        prop_assert_eq!(q.scales.len(), rows * cols / BLOCK);
        for r in 0..rows {
            for c in 0..cols {
                let s = e4m3_decode(q.scale_code(r, c)) as f64 * q.global_scale as f64;
                let got = q.value(r, c);
                let x = w[r * cols + c] as f64;
                // Normal block scales only: a subnormal e4m3 scale may round down by
                // far more than 1/16 and push the block into saturation.
                if q.scale_code(r, c) >= 0x08 {
                    let bound = e2m1_half_gap(got.abs() / s as f32) * s * (1.0 + 1e-5);
                    prop_assert!((got as f64 - x).abs() <= bound, "({r},{c}) {x} -> {got}");
                }
            }
        }
        prop_assert_eq!(q.dequantize().len(), rows * cols);
    }

    #[test]
    fn representable_matrices_round_trip_exactly(
        rows in 1usize..6, blocks in 1usize..4, seed in any::<u64>(), g in -20i32..20,
    ) {
        // Every block: scale s (a normal e4m3 value), codes with one ±6; one block has
        // s = 448 so the tensor amax is 6 * 448 * 2^g and the global scale is 2^g.
        let cols = blocks * BLOCK;
        let mut rng = Rng::new(seed);
        let gs = 2f32.powi(g);
        let mut w = Vec::with_capacity(rows * cols);
        for b in 0..rows * blocks {
            let s = if b == 0 { 448.0 } else { e4m3_decode(0x08 + rng.below(0x76) as u8) };
            let six_at = rng.below(BLOCK);
            for i in 0..BLOCK {
                let code = if i == six_at { 0x7 | (rng.below(2) as u8) << 3 } else { rng.below(16) as u8 };
                w.push(e2m1_decode(code) * s * gs);
            }
        }
        let q = Nvfp4Matrix::quantize(&w, rows, cols).unwrap();
        prop_assert_eq!(q.global_scale, gs);
        prop_assert_eq!(q.dequantize(), w);
    }

    #[test]
    fn packed_words_hold_eight_codes_each(rows in 1usize..5, blocks in 1usize..4, seed in any::<u64>()) {
        let cols = blocks * BLOCK;
        let w = normal_with_outliers(&mut Rng::new(seed), rows * cols, 1.0);
        let q = Nvfp4Matrix::quantize(&w, rows, cols).unwrap();
        let words = q.packed_words();
        for i in 0..rows * cols {
            let nibble = (words[i / 8] >> (4 * (i % 8))) & 0xf;
            prop_assert_eq!(nibble as u8, q.code(i / cols, i % cols));
        }
        let sw = q.scale_words();
        for (i, &s) in q.scales.iter().enumerate() {
            prop_assert_eq!((sw[i / 4] >> (8 * (i % 4))) as u8, s);
        }
    }

    #[test]
    fn grouped_gemm_is_per_expert_gemm(
        counts in proptest::collection::vec(0usize..5, 1..5), n in 1usize..7, k in 1usize..13,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let mut offsets = vec![0];
        for c in &counts {
            offsets.push(offsets.last().unwrap() + c);
        }
        let rows = *offsets.last().unwrap();
        let a = normal_with_outliers(&mut rng, rows * k, 1.0);
        let w = normal_with_outliers(&mut rng, counts.len() * n * k, 1.0);
        let c = grouped_gemm_nt(&a, &w, &offsets, n, k);
        let m = grouped_gemm_nt_magnitude(&a, &w, &offsets, n, k);
        prop_assert_eq!(c.len(), rows * n);
        for e in 0..counts.len() {
            let (lo, hi) = (offsets[e], offsets[e + 1]);
            let we = &w[e * n * k..(e + 1) * n * k];
            prop_assert_eq!(&c[lo * n..hi * n], &gemm_nt(&a[lo * k..hi * k], we, hi - lo, n, k)[..]);
            prop_assert_eq!(&m[lo * n..hi * n], &gemm_nt_magnitude(&a[lo * k..hi * k], we, hi - lo, n, k)[..]);
        }
        prop_assert!(c.iter().zip(&m).all(|(c, m)| c.abs() <= *m));
    }

    #[test]
    fn quantize_experts_matches_one_by_one(experts in 1usize..4, rows in 1usize..4, seed in any::<u64>()) {
        let w = normal_with_outliers(&mut Rng::new(seed), experts * rows * 32, 2.0);
        let qs = quantize_experts(&w, experts, rows, 32).unwrap();
        for (e, q) in qs.iter().enumerate() {
            let one = Nvfp4Matrix::quantize(&w[e * rows * 32..(e + 1) * rows * 32], rows, 32).unwrap();
            prop_assert_eq!(q, &one);
        }
    }

    #[test]
    fn rmsnorm_is_scale_invariant_and_softmax_rows_sum_to_one(
        rows in 1usize..5, dim in 1usize..37, seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let x = normal_with_outliers(&mut rng, rows * dim, 1.0);
        let wt = normal_with_outliers(&mut rng, dim, 1.0);
        let y = rmsnorm(&x, &wt, 0.0);
        let x4: Vec<f32> = x.iter().map(|v| v * 4.0).collect();
        for (a, b) in y.iter().zip(rmsnorm(&x4, &wt, 0.0)) {
            prop_assert!((a - b).abs() <= 1e-12 * a.abs().max(1.0));
        }
        for row in softmax(&x, dim).chunks(dim) {
            prop_assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn rope_scores_depend_only_on_relative_position(
        m in 0usize..5000, n in 0usize..5000, shift in 0usize..5000, seed in any::<u64>(),
    ) {
        let cfg = YarnConfig::kimi_k2();
        let mut rng = Rng::new(seed);
        let q = normal_with_outliers(&mut rng, 64, 1.0);
        let k = normal_with_outliers(&mut rng, 64, 1.0);
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let s1 = dot(&apply_interleaved(&q, &[m], 64, &cfg), &apply_interleaved(&k, &[n], 64, &cfg));
        let s2 = dot(
            &apply_interleaved(&q, &[m + shift], 64, &cfg),
            &apply_interleaved(&k, &[n + shift], 64, &cfg),
        );
        let mag: f64 = q.iter().zip(&k).map(|(a, b)| (a * b).abs() as f64).sum();
        prop_assert!((s1 - s2).abs() <= 1e-9 * mag, "{s1} vs {s2}");
    }

    #[test]
    fn attention_output_lies_within_the_value_magnitude(
        q_len in 1usize..4, extra in 0usize..9, heads in 1usize..4, page_size in 1usize..6,
        seed in any::<u64>(),
    ) {
        let mut rng = Rng::new(seed);
        let kv_len = q_len + extra;
        let num_pages = kv_len.div_ceil(page_size) + 1;
        let rows = normal_with_outliers(&mut rng, num_pages * page_size * KV_DIM, 1.0);
        let kv = PagedKv { page_size, num_pages, rows };
        let table: Vec<u32> = (0..num_pages as u32).rev().collect();
        let batch = AttnBatch { q_lens: vec![q_len, 1], kv_lens: vec![kv_len, 1], block_tables: vec![table.clone(), table], trees: Vec::new() };
        let q = normal_with_outliers(&mut rng, (q_len + 1) * heads * KV_DIM, 0.1);
        let res = mla_attention(&q, heads, &kv, &batch, 0.06);
        prop_assert_eq!(res.out.len(), (q_len + 1) * heads * KV_LORA_RANK);
        for (i, chunk) in res.out.chunks(KV_LORA_RANK).enumerate() {
            let vmax = res.value_magnitude[i];
            prop_assert!(chunk.iter().all(|v| v.abs() <= vmax * (1.0 + 1e-12)));
            prop_assert!(res.score_magnitude[i] > 0.0);
        }
    }

    #[test]
    fn routing_picks_distinct_experts_with_weights_summing_to_the_scale(
        tokens in 1usize..5, seed in any::<u64>(), deepseek in any::<bool>(),
    ) {
        let cfg = if deepseek { GateConfig::deepseek_v3() } else { GateConfig::kimi_k2() };
        let mut rng = Rng::new(seed);
        let logits = normal_with_outliers(&mut rng, tokens * cfg.n_routed_experts, 2.0);
        let bias = normal_with_outliers(&mut rng, cfg.n_routed_experts, 0.1);
        let r = route(&logits, &bias, &cfg);
        let k = cfg.num_experts_per_tok;
        for t in 0..tokens {
            let mut e = r.experts[t * k..(t + 1) * k].to_vec();
            e.sort();
            e.dedup();
            prop_assert_eq!(e.len(), k);
            let sum: f64 = r.weights[t * k..(t + 1) * k].iter().sum();
            prop_assert!((sum - cfg.routed_scaling_factor).abs() < 1e-12);
            let groups: std::collections::BTreeSet<usize> =
                e.iter().map(|x| x / (cfg.n_routed_experts / cfg.n_group)).collect();
            prop_assert!(groups.len() <= cfg.topk_group);
        }
    }

    #[test]
    fn tree_mask_rows_count_depth_plus_one(n in 1usize..20, seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        let parents: Vec<i32> = (0..n).map(|i| if i == 0 { -1 } else { rng.below(i) as i32 }).collect();
        let tree = Tree { parents: parents.clone(), tokens: vec![0; n] };
        prop_assert!(tree.validate().is_ok());
        let mask = tree_mask(&parents);
        for i in 0..n {
            prop_assert_eq!(mask[i * n..(i + 1) * n].iter().filter(|&&b| b).count(), tree.depth(i) + 1);
            prop_assert!(mask[i * n + i] && mask[i * n]);
        }
    }
}
