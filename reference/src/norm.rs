//! RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, row by row, in f64.
//!
//! Rows are the consecutive `weight.len()`-element slices of `x`. Follows HF
//! transformers' `DeepseekV3RMSNorm` (which computes in f32 and multiplies by the
//! weight after casting back to the input dtype); here every step is f64, so the
//! result is the exact value that tolerance bounds are measured against.

/// Row-wise RMSNorm of `x` (`[rows, weight.len()]`) with per-column `weight`.
///
/// Panics if `weight` is empty or `x.len()` is not a multiple of `weight.len()`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f64> {
    rmsnorm_rows(x, weight, eps as f64)
}

/// [`rmsnorm`] of f64 rows (a model's hidden states, kept in f64), with an f64 `eps`.
///
/// Panics if `weight` is empty or `x.len()` is not a multiple of `weight.len()`.
pub fn rmsnorm_f64(x: &[f64], weight: &[f32], eps: f64) -> Vec<f64> {
    rmsnorm_rows(x, weight, eps)
}

fn rmsnorm_rows<T: Copy + Into<f64>>(x: &[T], weight: &[f32], eps: f64) -> Vec<f64> {
    let dim = weight.len();
    assert!(dim > 0, "weight is empty");
    assert_eq!(
        x.len() % dim,
        0,
        "x has {} elements, not a multiple of {dim}",
        x.len()
    );
    x.chunks(dim)
        .flat_map(|row| {
            let mean_sq = row.iter().map(|&v| v.into().powi(2)).sum::<f64>() / dim as f64;
            let inv_rms = 1.0 / (mean_sq + eps).sqrt();
            row.iter()
                .zip(weight)
                .map(move |(&v, &w)| v.into() * inv_rms * w as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_rms_row_is_unchanged_times_weight() {
        // First row has rms 1, second rms 2.
        let y = rmsnorm(
            &[1.0, -1.0, 1.0, -1.0, 2.0, 2.0, 2.0, 2.0],
            &[1.0, 2.0, 3.0, 4.0],
            0.0,
        );
        assert_eq!(y, vec![1.0, -2.0, 3.0, -4.0, 1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn eps_keeps_zero_rows_finite() {
        assert_eq!(rmsnorm(&[0.0; 3], &[1.0; 3], 1e-6), vec![0.0; 3]);
    }
}
