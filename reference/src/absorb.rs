//! MLA weight absorption: the two per-head products that let attention run in the
//! compressed (MQA) form over the 576-wide cache rows instead of full keys and values.
//!
//! `kv_b_proj.weight` is `[heads * (nope + v), kv_lora]`: for head `h`, rows
//! `h*(nope+v) .. h*(nope+v)+nope` are `W_UK^T` and the next `v` rows are `W_UV^T`.
//! - [`absorb_query`]: `q_abs[t, h] = [q_nope[t, h] W_UK_h  |  q_pe[t, h]]`, so that
//!   `q_abs . [c_kv | k_pe] = q_nope . k_nope + q_pe . k_pe` (DeepSeek-V2's absorption);
//! - [`project_values`]: `o[t, h] = latent_out[t, h] W_UV_h`, turning the attention's
//!   512-wide output back into the `v_head_dim` values `o_proj` expects.
//!
//! In f64, with `sum |a b|` magnitudes for the tolerance helper.

/// The kv_b_proj weight and its split.
#[derive(Clone, Copy, Debug)]
pub struct KvB<'a> {
    pub weight: &'a [f32],
    pub heads: usize,
    pub nope: usize,
    pub v: usize,
    pub kv_lora: usize,
}

impl KvB<'_> {
    fn row(&self, h: usize, r: usize) -> &[f32] {
        let at = (h * (self.nope + self.v) + r) * self.kv_lora;
        &self.weight[at..at + self.kv_lora]
    }
}

/// `q` is `[tokens, heads, nope + rope]`; returns `[tokens, heads, kv_lora + rope]` and the
/// per-element magnitudes (`sum |q w|` for the absorbed part, `|q_pe|` for the rope part).
pub fn absorb_query(q: &[f32], kvb: &KvB, rope: usize) -> (Vec<f64>, Vec<f64>) {
    let width = kvb.nope + rope;
    assert_eq!(
        q.len() % (kvb.heads * width),
        0,
        "q is not [tokens, heads, nope + rope]"
    );
    let (mut out, mut mag) = (Vec::new(), Vec::new());
    for (i, qh) in q.chunks(width).enumerate() {
        let h = i % kvb.heads;
        for c in 0..kvb.kv_lora {
            let (mut s, mut m) = (0.0f64, 0.0f64);
            for (d, &qd) in qh[..kvb.nope].iter().enumerate() {
                let p = qd as f64 * kvb.row(h, d)[c] as f64;
                s += p;
                m += p.abs();
            }
            out.push(s);
            mag.push(m);
        }
        for &r in &qh[kvb.nope..] {
            out.push(r as f64);
            mag.push((r as f64).abs());
        }
    }
    (out, mag)
}

/// `latent` is `[tokens, heads, kv_lora]`; returns `[tokens, heads, v]` and magnitudes.
pub fn project_values(latent: &[f32], kvb: &KvB) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(
        latent.len() % (kvb.heads * kvb.kv_lora),
        0,
        "latent is not [tokens, heads, kv_lora]"
    );
    let (mut out, mut mag) = (Vec::new(), Vec::new());
    for (i, lh) in latent.chunks(kvb.kv_lora).enumerate() {
        let h = i % kvb.heads;
        for j in 0..kvb.v {
            let w = kvb.row(h, kvb.nope + j);
            let (mut s, mut m) = (0.0f64, 0.0f64);
            for (&a, &b) in lh.iter().zip(w) {
                let p = a as f64 * b as f64;
                s += p;
                m += p.abs();
            }
            out.push(s);
            mag.push(m);
        }
    }
    (out, mag)
}
