//! Multi-head latent attention in its per-head (unabsorbed) form, as SGLang and vLLM run
//! prefill: each context row's latent `c_kv` is expanded by `kv_b_proj` into per-head keys
//! `k_nope = W_UK_h c_kv` and values `v = W_UV_h c_kv`; the rope part `k_pe` stays shared.
//! For query `t`, head `h` (`q = [q_nope | q_pe]`, `q_pe` rotated):
//! `s_j = softmax_scale * (q_nope . k_nope_j + q_pe . k_pe_j)`, `out[t, h] = sum_j
//! softmax(s)_j v_j`, `[tokens, heads, v]`: the values `o_proj` takes. It equals the
//! absorbed form ([`crate::mla::mla_attention`] then [`crate::absorb::project_values`])
//! in exact arithmetic, with 192 + 128 products per head and position instead of
//! 576 + 512. Same batches, visibility and cache as [`crate::mla`]; computed in f64.
use crate::absorb::KvB;
use crate::mla::{AttnBatch, AttnOutput, PagedKv, KV_LORA_RANK};
use crate::softmax::softmax_row;

/// One context row expanded for one head: keys and values with the magnitudes of their
/// products (`sum_c |w c|`), and the shared rope part.
struct Expanded {
    k: Vec<(f64, f64)>,
    v: Vec<(f64, f64)>,
}

/// `W_UK_h c` and `W_UV_h c` for latent `c`.
fn expand(latent: &[f32], kvb: &KvB, h: usize) -> Expanded {
    let dot = |r: usize| {
        let w = &kvb.weight[(h * (kvb.nope + kvb.v) + r) * kvb.kv_lora..][..kvb.kv_lora];
        w.iter().zip(latent).fold((0.0, 0.0), |(s, m), (&a, &b)| {
            let p = a as f64 * b as f64;
            (s + p, m + p.abs())
        })
    };
    Expanded {
        k: (0..kvb.nope).map(dot).collect(),
        v: (kvb.nope..kvb.nope + kvb.v).map(dot).collect(),
    }
}

/// Per-head MLA attention: `q` is `[T, heads, nope + 64]` (rope part rotated), tokens in
/// request order; returns `[T, heads, v]`. `value_magnitude` is per `(t, h)` the largest
/// `sum_c |w c|` of the visible values, `score_magnitude` `softmax_scale * max_j (sum_d
/// |q_d| sum_c |w c| + sum |q_pe k_pe|)`: the products' sizes through the expansion.
///
/// Panics if the batch does not validate against `kv`, `q` has the wrong length or
/// `kvb.kv_lora` is not the cache's latent width.
pub fn mla_attention_heads(
    q: &[f32],
    kv: &PagedKv,
    batch: &AttnBatch,
    kvb: &KvB,
    softmax_scale: f32,
) -> AttnOutput {
    if let Err(e) = batch.validate(kv) {
        panic!("invalid attention batch: {e}");
    }
    assert_eq!(
        kvb.kv_lora, KV_LORA_RANK,
        "kv_b_proj reads the cache's latent"
    );
    let (heads, width) = (kvb.heads, kvb.nope + 64);
    let tokens = batch.num_tokens();
    assert_eq!(
        q.len(),
        tokens * heads * width,
        "q is not [{tokens}, {heads}, {width}]"
    );
    let scale = softmax_scale as f64;
    let mut res = AttnOutput {
        out: Vec::with_capacity(tokens * heads * kvb.v),
        value_magnitude: Vec::with_capacity(tokens * heads),
        score_magnitude: Vec::with_capacity(tokens * heads),
    };
    let mut t = 0;
    for (b, &q_len) in batch.q_lens.iter().enumerate() {
        // Each context row expanded once per head: [position][head].
        let rows: Vec<&[f32]> = (0..batch.kv_lens[b])
            .map(|p| kv.row(batch.row_of(b, p, kv.page_size)))
            .collect();
        let expanded: Vec<Vec<Expanded>> = rows
            .iter()
            .map(|r| {
                (0..heads)
                    .map(|h| expand(&r[..KV_LORA_RANK], kvb, h))
                    .collect()
            })
            .collect();
        for i in 0..q_len {
            let visible = batch.visible_positions(b, i);
            for h in 0..heads {
                let qh = &q[(t * heads + h) * width..(t * heads + h + 1) * width];
                let (q_nope, q_pe) = qh.split_at(kvb.nope);
                let (mut scores, mut mag) = (Vec::new(), 0.0f64);
                for &p in &visible {
                    let e = &expanded[p][h];
                    let pe = &rows[p][KV_LORA_RANK..];
                    let (mut s, mut m) = (0.0, 0.0);
                    for (&a, &(k, km)) in q_nope.iter().zip(&e.k) {
                        s += a as f64 * k;
                        m += (a as f64).abs() * km;
                    }
                    for (&a, &k) in q_pe.iter().zip(pe) {
                        s += a as f64 * k as f64;
                        m += (a as f64 * k as f64).abs();
                    }
                    scores.push(scale * s);
                    mag = mag.max(scale * m);
                }
                let probs = softmax_row(scores.into_iter());
                let mut acc = vec![0.0f64; kvb.v];
                let mut value_mag = 0.0f64;
                for (w, &p) in probs.iter().zip(&visible) {
                    for (a, &(v, vm)) in acc.iter_mut().zip(&expanded[p][h].v) {
                        *a += w * v;
                        value_mag = value_mag.max(vm);
                    }
                }
                res.out.extend(acc);
                res.score_magnitude.push(mag);
                res.value_magnitude.push(value_mag);
            }
            t += 1;
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::absorb::{absorb_query, project_values};
    use crate::data::{normal_with_outliers, Rng};
    use crate::mla::{mla_attention, KV_DIM};

    /// The per-head form and the absorbed form (absorb the query, attend over the 576-wide
    /// rows, project the latent output) are the same function: over ragged batches with
    /// prefixes, shuffled pages and a draft tree.
    #[test]
    fn the_per_head_form_equals_the_absorbed_form() {
        let mut rng = Rng::new(7);
        let (heads, nope, v, page) = (3, 16, 8, 4);
        let kv_lens = [9, 5, 14];
        let q_lens = [4, 5, 3];
        let num_pages = 12;
        let mut pages: Vec<u32> = (0..num_pages as u32).collect();
        rng.shuffle(&mut pages);
        let mut free = pages.into_iter();
        let block_tables: Vec<Vec<u32>> = kv_lens
            .iter()
            .map(|&l: &usize| free.by_ref().take(l.div_ceil(page)).collect())
            .collect();
        let kv = PagedKv {
            page_size: page,
            num_pages,
            rows: normal_with_outliers(&mut rng, num_pages * page * KV_DIM, 1.0),
        };
        let batch = AttnBatch {
            q_lens: q_lens.to_vec(),
            kv_lens: kv_lens.to_vec(),
            block_tables,
            trees: vec![None, Some(vec![-1, 0, 0, 1]), None],
        };
        let weight = normal_with_outliers(&mut rng, heads * (nope + v) * KV_LORA_RANK, 0.05);
        let kvb = KvB {
            weight: &weight,
            heads,
            nope,
            v,
            kv_lora: KV_LORA_RANK,
        };
        let q = normal_with_outliers(&mut rng, batch.num_tokens() * heads * (nope + 64), 1.0);
        let scale = 0.1;
        let per_head = mla_attention_heads(&q, &kv, &batch, &kvb, scale);
        let (absorbed_q, _) = absorb_query(&q, &kvb, 64);
        let absorbed_q: Vec<f32> = absorbed_q.iter().map(|&x| x as f32).collect();
        // The absorbed query is rounded to f32 on the way: compare within that.
        let latent = mla_attention(&absorbed_q, heads, &kv, &batch, scale);
        let latent: Vec<f32> = latent.out.iter().map(|&x| x as f32).collect();
        let (absorbed, _) = project_values(&latent, &kvb);
        assert_eq!(per_head.out.len(), absorbed.len());
        for (i, (a, b)) in per_head.out.iter().zip(&absorbed).enumerate() {
            let m = per_head.value_magnitude[i / v];
            assert!(
                (a - b).abs() <= 1e-5 * m,
                "element {i}: {a} against {b} (|v| {m})"
            );
        }
    }
}
