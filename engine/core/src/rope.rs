//! YaRN rotary-embedding parameters and the host-side numbers derived from them: the
//! per-pair inverse frequencies, the cos/sin multiplier and the attention softmax scale.
//! The engine uploads these once; the rotation itself is a kernel (`kiln_kernels::rope`)
//! whose oracle is `kiln_reference::rope`.
//!
//! YaRN ("NTK-by-parts") blends, per frequency, the original `theta^(-2i/d)` (fast
//! dimensions, `i < low`) with the interpolated `theta^(-2i/d) / factor` (slow dimensions,
//! `i > high`) through a linear ramp between the correction dimensions of `beta_fast` and
//! `beta_slow`. Follows DeepSeek-V3's `inference/model.py` (`precompute_freqs_cis`) and HF
//! transformers' `DeepseekV3YarnRotaryEmbedding` (`yarn_find_correction_range`,
//! `yarn_linear_ramp_mask`, `yarn_get_mscale`), in f64.

/// YaRN rope-scaling parameters, named as in the HF config's `rope_scaling`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnConfig {
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Context extension factor.
    pub factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Rotations within the original context above which a dimension is left as is.
    pub beta_fast: f64,
    /// Rotations within the original context below which a dimension is interpolated.
    pub beta_slow: f64,
    /// mscale applied to cos/sin (numerator of the ratio).
    pub mscale: f64,
    /// mscale applied to all dims (denominator of the ratio; also squared in the
    /// softmax scale).
    pub mscale_all_dim: f64,
}

impl YarnConfig {
    /// Kimi K2.x: theta 50000, factor 64, original context 4096.
    pub fn kimi_k2() -> Self {
        Self {
            rope_theta: 50000.0,
            factor: 64.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }
    }

    /// DeepSeek-V3: theta 10000, factor 40, original context 4096.
    pub fn deepseek_v3() -> Self {
        Self {
            rope_theta: 10000.0,
            factor: 40.0,
            ..Self::kimi_k2()
        }
    }
}

/// YaRN attention-temperature factor: `0.1 * mscale * ln(scale) + 1`, or 1 when
/// `scale <= 1`.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The (fractional) dimension index whose wavelength fits `num_rotations` times in
/// the original context.
fn correction_dim(num_rotations: f64, dim: usize, cfg: &YarnConfig) -> f64 {
    let ctx = cfg.original_max_position_embeddings as f64;
    dim as f64 * (ctx / (num_rotations * 2.0 * std::f64::consts::PI)).ln()
        / (2.0 * cfg.rope_theta.ln())
}

/// `(low, high)`: floor/ceil of the correction dims of `beta_fast`/`beta_slow`,
/// clamped to `[0, dim - 1]`.
pub fn yarn_find_correction_range(dim: usize, cfg: &YarnConfig) -> (f64, f64) {
    let low = correction_dim(cfg.beta_fast, dim, cfg).floor();
    let high = correction_dim(cfg.beta_slow, dim, cfg).ceil();
    (low.max(0.0), high.min(dim as f64 - 1.0))
}

/// Ramp value of frequency index `i`: 0 at or below `low`, 1 at or above `high`,
/// linear in between (`high` is nudged by 0.001 when equal to `low`).
pub fn yarn_linear_ramp(low: f64, high: f64, i: usize) -> f64 {
    let high = if low == high { high + 0.001 } else { high };
    ((i as f64 - low) / (high - low)).clamp(0.0, 1.0)
}

/// The `rope_dim / 2` YaRN inverse frequencies:
/// `extra * (1 - ramp) + (extra / factor) * ramp` with `extra = theta^(-2i/rope_dim)`.
pub fn inv_freq(rope_dim: usize, cfg: &YarnConfig) -> Vec<f64> {
    assert!(
        rope_dim.is_multiple_of(2) && rope_dim > 0,
        "rope_dim {rope_dim} must be even"
    );
    let (low, high) = yarn_find_correction_range(rope_dim, cfg);
    (0..rope_dim / 2)
        .map(|i| {
            let extra = 1.0 / cfg.rope_theta.powf((2 * i) as f64 / rope_dim as f64);
            let inter = extra / cfg.factor;
            let ramp = yarn_linear_ramp(low, high, i);
            inter * ramp + extra * (1.0 - ramp)
        })
        .collect()
}

/// The multiplier on cos and sin:
/// `yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`
/// (exactly 1 for both shipped configs).
pub fn cos_sin_scale(cfg: &YarnConfig) -> f64 {
    yarn_get_mscale(cfg.factor, cfg.mscale) / yarn_get_mscale(cfg.factor, cfg.mscale_all_dim)
}

/// Attention softmax scale: `qk_head_dim^-0.5 * yarn_get_mscale(factor, mscale_all_dim)^2`.
pub fn softmax_scale(qk_head_dim: usize, cfg: &YarnConfig) -> f64 {
    let m = yarn_get_mscale(cfg.factor, cfg.mscale_all_dim);
    (qk_head_dim as f64).powf(-0.5) * m * m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_softmax_scale_matches_the_published_value() {
        let s = softmax_scale(192, &YarnConfig::kimi_k2());
        assert!((s - 0.144680).abs() < 1e-6, "{s}");
    }

    #[test]
    fn kimi_correction_range_and_frequency_ends() {
        let cfg = YarnConfig::kimi_k2();
        assert_eq!(yarn_find_correction_range(64, &cfg), (8.0, 20.0));
        let f = inv_freq(64, &cfg);
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        // Fast dims are untouched, slow dims are divided by the factor.
        assert_eq!(f[8], 50000f64.powf(-16.0 / 64.0));
        let slowest = 50000f64.powf(-62.0 / 64.0) / 64.0;
        assert!((f[31] - slowest).abs() <= 1e-15 * slowest);
        assert_eq!(cos_sin_scale(&cfg), 1.0);
    }
}
