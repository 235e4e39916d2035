//! Unit tests of paged MLA attention and the FP8 KV row layout.

use super::*;
use crate::data::{normal_with_outliers, Rng};

fn cache(rng: &mut Rng, page_size: usize, num_pages: usize) -> PagedKv {
    let rows = normal_with_outliers(rng, page_size * num_pages * KV_DIM, 1.0);
    PagedKv {
        page_size,
        num_pages,
        rows,
    }
}

#[test]
fn fp8_layout_is_656_bytes() {
    assert_eq!(FP8_KV_BYTES, 656);
    assert_eq!(KV_DIM, 576);
}

#[test]
fn fp8_row_round_trip_is_within_half_an_e4m3_step() {
    let mut rng = Rng::new(7);
    let row = normal_with_outliers(&mut rng, KV_DIM, 3.0);
    let bytes = fp8_row_encode(&row);
    let back = fp8_row_decode(&bytes);
    for t in 0..4 {
        let tile = &row[t * 128..(t + 1) * 128];
        let amax = tile.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = f32::from_le_bytes(bytes[512 + 4 * t..516 + 4 * t].try_into().unwrap());
        assert_eq!(scale, fp8_tile_scale(amax));
        for j in 0..128 {
            let (x, y) = (tile[j] as f64, back[t * 128 + j] as f64);
            // Normal e4m3: relative half-step 2^-4; subnormal: absolute 2^-10 * scale (the
            // division and the product by a power of two are exact).
            let bound = (x.abs() / 16.0).max(scale as f64 / 1024.0);
            assert!((x - y).abs() <= bound, "tile {t} elem {j}: {x} vs {y}");
        }
    }
    for j in 512..576 {
        assert_eq!(back[j], bf16_round(row[j]));
    }
}

#[test]
fn fp8_tile_scales_are_the_smallest_powers_of_two_that_fit() {
    let cases = [
        (448.0, 1.0),
        (f32::from_bits(448f32.to_bits() + 1), 2.0),
        (224.0, 0.5),
        (3.5, 2f32.powi(-7)),
        (1.0, 2f32.powi(-8)),
        (f32::MAX, 2f32.powi(120)),
        (f32::from_bits(1), 2f32.powi(-126)),
        (448.0 * 2f32.powi(-126), 2f32.powi(-126)),
    ];
    for (amax, want) in cases {
        assert_eq!(fp8_tile_scale(amax), want, "amax {amax:e}");
    }
    let mut rng = Rng::new(11);
    for _ in 0..10_000 {
        let amax = f32::from_bits(rng.next_u64() as u32 % 0x7f80_0000); // finite, >= 0
        let scale = fp8_tile_scale(amax);
        assert_eq!(
            scale.to_bits() & 0x807f_ffff,
            0,
            "{scale:e} is a power of two"
        );
        let ratio = amax as f64 / scale as f64;
        assert!(ratio <= 448.0, "amax {amax:e} / {scale:e} fits");
        assert!(
            ratio > 224.0 || scale == 2f32.powi(-126),
            "{scale:e} is the smallest"
        );
    }
}

#[test]
fn fp8_zero_tile_uses_unit_scale() {
    let mut row = vec![0.0f32; KV_DIM];
    row[300] = -3.5; // tile 2's scale 3.5 / 448 = 2^-7 is exact
    let bytes = fp8_row_encode(&row);
    assert_eq!(f32::from_le_bytes(bytes[512..516].try_into().unwrap()), 1.0);
    assert_eq!(bytes[300], 0xfe); // the tile's amax encodes as -448
    assert_eq!(fp8_row_decode(&bytes)[300], -3.5);
    assert!(fp8_row_decode(&bytes)[..300].iter().all(|&v| v == 0.0));
}

#[test]
fn single_visible_row_returns_its_latent() {
    let mut rng = Rng::new(1);
    let kv = cache(&mut rng, 4, 2);
    let batch = AttnBatch {
        q_lens: vec![1],
        kv_lens: vec![1],
        block_tables: vec![vec![1]],
        trees: Vec::new(),
    };
    let q = normal_with_outliers(&mut rng, 2 * KV_DIM, 1.0);
    let res = mla_attention(&q, 2, &kv, &batch, 0.1);
    let row = kv.row(4); // page 1, slot 0
    for h in 0..2 {
        for d in 0..KV_LORA_RANK {
            assert_eq!(res.out[h * KV_LORA_RANK + d], row[d] as f64);
        }
    }
    assert_eq!(res.out.len(), 2 * KV_LORA_RANK);
}

#[test]
fn equal_scores_average_the_values() {
    let mut kv = PagedKv {
        page_size: 2,
        num_pages: 1,
        rows: vec![0.0; 2 * KV_DIM],
    };
    kv.rows[0] = 1.0;
    kv.rows[KV_DIM] = 3.0;
    let batch = AttnBatch {
        q_lens: vec![1],
        kv_lens: vec![2],
        block_tables: vec![vec![0]],
        trees: Vec::new(),
    };
    let q = vec![0.0f32; KV_DIM]; // all scores zero
    let res = mla_attention(&q, 1, &kv, &batch, 1.0);
    assert_eq!(res.out[0], 2.0);
    assert_eq!(res.value_magnitude, vec![3.0]);
    assert_eq!(res.score_magnitude, vec![0.0]);
}

#[test]
fn paging_does_not_change_the_result() {
    // One request of 7 tokens over pages of 2: contiguous pages 0..4 versus the same
    // rows scattered over pages [3, 0, 2, 1] of another cache.
    let mut rng = Rng::new(3);
    let contiguous = cache(&mut rng, 2, 4);
    let order = [3usize, 0, 2, 1];
    let mut scattered = contiguous.clone();
    for (logical, &page) in order.iter().enumerate() {
        let (src, dst) = (logical * 2 * KV_DIM, page * 2 * KV_DIM);
        scattered.rows[dst..dst + 2 * KV_DIM]
            .copy_from_slice(&contiguous.rows[src..src + 2 * KV_DIM]);
    }
    let q = normal_with_outliers(&mut rng, 3 * 3 * KV_DIM, 0.5);
    let a = AttnBatch {
        q_lens: vec![3],
        kv_lens: vec![7],
        block_tables: vec![vec![0, 1, 2, 3]],
        trees: Vec::new(),
    };
    let b = AttnBatch {
        block_tables: vec![order.iter().map(|&p| p as u32).collect()],
        trees: Vec::new(),
        ..a.clone()
    };
    assert_eq!(
        mla_attention(&q, 3, &contiguous, &a, 0.07),
        mla_attention(&q, 3, &scattered, &b, 0.07)
    );
}

#[test]
fn prefill_is_causal() {
    // q_len == kv_len: query 0 sees only position 0, so it returns row 0's latent.
    let mut rng = Rng::new(4);
    let kv = cache(&mut rng, 4, 1);
    let batch = AttnBatch {
        q_lens: vec![3],
        kv_lens: vec![3],
        block_tables: vec![vec![0]],
        trees: Vec::new(),
    };
    let q = normal_with_outliers(&mut rng, 3 * KV_DIM, 1.0);
    let res = mla_attention(&q, 1, &kv, &batch, 0.1);
    for d in 0..KV_LORA_RANK {
        assert_eq!(res.out[d], kv.rows[d] as f64);
    }
    // Changing a future row leaves earlier queries alone.
    let mut later = kv.clone();
    later.rows[2 * KV_DIM] += 100.0;
    let res2 = mla_attention(&q, 1, &later, &batch, 0.1);
    assert_eq!(res.out[..2 * KV_LORA_RANK], res2.out[..2 * KV_LORA_RANK]);
    assert_ne!(res.out[2 * KV_LORA_RANK..], res2.out[2 * KV_LORA_RANK..]);
}

#[test]
fn validate_reports_each_problem() {
    let kv = PagedKv {
        page_size: 4,
        num_pages: 2,
        rows: vec![0.0; 8 * KV_DIM],
    };
    let ok = AttnBatch {
        q_lens: vec![1, 2],
        kv_lens: vec![5, 2],
        block_tables: vec![vec![1, 0], vec![1]],
        trees: Vec::new(),
    };
    assert_eq!(ok.validate(&kv), Ok(()));
    assert_eq!(ok.num_tokens(), 3);
    let mut b = ok.clone();
    b.q_lens[0] = 0;
    assert_eq!(b.validate(&kv), Err(MlaError::EmptyQuery { request: 0 }));
    let mut b = ok.clone();
    b.q_lens[1] = 3;
    assert_eq!(
        b.validate(&kv),
        Err(MlaError::QueryLongerThanContext {
            request: 1,
            q_len: 3,
            kv_len: 2
        })
    );
    let mut b = ok.clone();
    b.kv_lens[0] = 9;
    assert_eq!(
        b.validate(&kv),
        Err(MlaError::BlockTableTooShort {
            request: 0,
            pages: 2,
            needed: 3
        })
    );
    let mut b = ok.clone();
    b.block_tables[1][0] = 2;
    assert_eq!(
        b.validate(&kv),
        Err(MlaError::PageOutOfRange {
            request: 1,
            page: 2,
            num_pages: 2
        })
    );
    let mut b = ok.clone();
    b.trees = vec![None];
    assert_eq!(
        b.validate(&kv),
        Err(MlaError::TreeCountMismatch {
            trees: 1,
            requests: 2
        })
    );
    let mut b = ok.clone();
    b.trees = vec![None, Some(vec![-1, 0, 1])];
    assert!(matches!(
        b.validate(&kv),
        Err(MlaError::BadTree { request: 1, .. })
    ));
    let mut b = ok.clone();
    b.trees = vec![None, Some(vec![-1, 1])];
    assert!(matches!(
        b.validate(&kv),
        Err(MlaError::BadTree { request: 1, .. })
    ));
    let mut b = ok;
    b.kv_lens.pop();
    assert!(matches!(
        b.validate(&kv),
        Err(MlaError::RequestCountMismatch { .. })
    ));
}

/// A tree node attends exactly as a lone query over the rows before the tree followed by
/// its ancestors' rows (the path it would have as a chain); a chain tree is causal.
#[test]
fn tree_nodes_attend_as_their_paths() {
    let mut rng = Rng::new(9);
    let kv = cache(&mut rng, 4, 4);
    // 3 queries before the tree, then a 6-node tree: 0 -> {1, 2}, 1 -> 3, 2 -> {4, 5}.
    let parents = vec![-1, 0, 0, 1, 2, 2];
    let (q_len, kv_len) = (9, 13);
    let table = vec![3, 1, 0, 2];
    let batch = AttnBatch {
        q_lens: vec![q_len],
        kv_lens: vec![kv_len],
        block_tables: vec![table.clone()],
        trees: vec![Some(parents.clone())],
    };
    let heads = 2;
    let q = normal_with_outliers(&mut rng, q_len * heads * KV_DIM, 1.0);
    let res = mla_attention(&q, heads, &kv, &batch, 0.1);
    let start = kv_len - parents.len();
    let paths: [&[usize]; 6] = [&[0], &[0, 1], &[0, 2], &[0, 1, 3], &[0, 2, 4], &[0, 2, 5]];
    for (node, path) in paths.iter().enumerate() {
        let positions: Vec<usize> = (0..start).chain(path.iter().map(|&j| start + j)).collect();
        assert_eq!(
            batch.visible_positions(0, q_len - parents.len() + node),
            positions
        );
        let mut rows = Vec::new();
        for &p in &positions {
            rows.extend_from_slice(kv.row(batch.row_of(0, p, 4)));
        }
        let alone = PagedKv {
            page_size: positions.len(),
            num_pages: 1,
            rows,
        };
        let lone = AttnBatch {
            q_lens: vec![1],
            kv_lens: vec![positions.len()],
            block_tables: vec![vec![0]],
            trees: Vec::new(),
        };
        let t = q_len - parents.len() + node;
        let qt = &q[t * heads * KV_DIM..(t + 1) * heads * KV_DIM];
        let want = mla_attention(qt, heads, &alone, &lone, 0.1);
        let got = &res.out[t * heads * KV_LORA_RANK..(t + 1) * heads * KV_LORA_RANK];
        assert_eq!(got, &want.out[..]);
    }
    let chain = AttnBatch {
        trees: vec![Some(vec![-1, 0, 1, 2])],
        ..batch.clone()
    };
    let causal = AttnBatch {
        trees: vec![None],
        ..batch
    };
    assert_eq!(
        mla_attention(&q, heads, &kv, &chain, 0.1),
        mla_attention(&q, heads, &kv, &causal, 0.1)
    );
}

#[test]
fn fp8_and_bf16_cache_views_round_every_row() {
    let mut rng = Rng::new(5);
    let kv = cache(&mut rng, 2, 1);
    let fp8 = kv.fp8_round();
    assert_eq!(fp8.row(1), &fp8_row_decode(&fp8_row_encode(kv.row(1)))[..]);
    assert_eq!(kv.bf16_round().rows, bf16_row_round(&kv.rows));
}
