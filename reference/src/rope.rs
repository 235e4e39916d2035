//! YaRN-scaled rotary position embedding, interleaved pairs, in f64.
//!
//! Computes the rotation DeepSeek-V3 / Kimi-K2 apply to the 64 rope dimensions of q
//! and k: pair `(x[2i], x[2i+1])` at position `p` is rotated by `p * inv_freq[i]`, with
//! cos and sin multiplied by [`cos_sin_scale`]. YaRN ("NTK-by-parts") blends, per
//! frequency, the original `theta^(-2i/d)` (fast dimensions, `i < low`) with the
//! interpolated `theta^(-2i/d) / factor` (slow dimensions, `i > high`) through a
//! linear ramp between the correction dimensions of `beta_fast` and `beta_slow`. The
//! frequencies and scales are `kiln_core::rope`'s (the engine uploads the same numbers),
//! re-exported here; this module adds the rotation itself.
//!
//! Follows DeepSeek-V3's `inference/model.py` (`precompute_freqs_cis`,
//! `apply_rotary_emb`) and HF transformers' `DeepseekV3YarnRotaryEmbedding`
//! (`yarn_find_correction_range`, `yarn_linear_ramp_mask`, `yarn_get_mscale`).
//! Differences to keep in mind when comparing:
//! - this code keeps pairs interleaved in place, as the original code's complex
//!   multiply does; HF's `apply_rotary_pos_emb_interleave` de-interleaves first and
//!   returns `[even lanes | odd lanes]`, a fixed permutation of this result that
//!   leaves every q·k dot product unchanged;
//! - both peers compute frequencies and angles in f32; here everything is f64. An f32
//!   angle `p * inv_freq` is off by up to ~`p * 2^-24` radians, which at positions of
//!   10^5 is ~10^-2: kernels must compute angles in f32 no worse than the peers, and
//!   tolerances at long positions must account for it.

pub use kiln_core::rope::{
    cos_sin_scale, inv_freq, softmax_scale, yarn_find_correction_range, yarn_get_mscale,
    yarn_linear_ramp, YarnConfig,
};

/// Rotates interleaved pairs of `x` (`[tokens, rows_per_token, rope_dim]`, flattened):
/// every row of token `t` uses position `positions[t]`; pair `(x[2i], x[2i+1])` becomes
/// `(x0 cos - x1 sin, x0 sin + x1 cos)` with angle `pos * inv_freq[i]` and cos, sin
/// multiplied by [`cos_sin_scale`].
///
/// Panics if `x.len()` is not `positions.len() * rows_per_token * rope_dim`.
pub fn apply_interleaved(
    x: &[f32],
    positions: &[usize],
    rope_dim: usize,
    cfg: &YarnConfig,
) -> Vec<f64> {
    rotate_rows(x, positions, rope_dim, cfg)
}

/// [`apply_interleaved`] of f64 values (a model's activations, kept in f64).
pub fn apply_interleaved_f64(
    x: &[f64],
    positions: &[usize],
    rope_dim: usize,
    cfg: &YarnConfig,
) -> Vec<f64> {
    rotate_rows(x, positions, rope_dim, cfg)
}

fn rotate_rows<T: Copy + Into<f64>>(
    x: &[T],
    positions: &[usize],
    rope_dim: usize,
    cfg: &YarnConfig,
) -> Vec<f64> {
    let freqs = inv_freq(rope_dim, cfg);
    let scale = cos_sin_scale(cfg);
    assert_eq!(x.len() % rope_dim, 0, "x is not made of rope_dim rows");
    let rows = x.len() / rope_dim;
    assert!(
        !positions.is_empty() && rows.is_multiple_of(positions.len()),
        "{rows} rows do not split evenly over {} tokens",
        positions.len()
    );
    let rows_per_token = rows / positions.len();
    let mut out = Vec::with_capacity(x.len());
    for (r, row) in x.chunks(rope_dim).enumerate() {
        let pos = positions[r / rows_per_token] as f64;
        for (pair, &f) in row.chunks(2).zip(&freqs) {
            let (sin, cos) = (pos * f).sin_cos();
            let (x0, x1): (f64, f64) = (pair[0].into(), pair[1].into());
            out.push((x0 * cos - x1 * sin) * scale);
            out.push((x0 * sin + x1 * cos) * scale);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_norm_is_preserved() {
        let cfg = YarnConfig::deepseek_v3();
        let x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.37).sin()).collect();
        let y = apply_interleaved(&x, &[0, 12345], 64, &cfg);
        for i in 0..64 {
            assert_eq!(y[i], x[i] as f64);
        }
        for i in (64..128).step_by(2) {
            let before = (x[i] as f64).hypot(x[i + 1] as f64);
            let after = y[i].hypot(y[i + 1]);
            assert!((before - after).abs() < 1e-12);
        }
    }

    #[test]
    fn pair_zero_rotates_by_the_position_in_radians() {
        // inv_freq[0] = 1, so position p rotates pair 0 by p radians.
        let cfg = YarnConfig::kimi_k2();
        let mut x = vec![0.0f32; 4];
        x[0] = 1.0;
        let y = apply_interleaved(&x, &[0], 4, &cfg);
        assert_eq!(&y[..2], &[1.0, 0.0]);
        let rotated = apply_interleaved(&x, &[3], 4, &cfg);
        assert!((rotated[0] - 3f64.cos()).abs() < 1e-15);
        assert!((rotated[1] - 3f64.sin()).abs() < 1e-15);
    }
}
