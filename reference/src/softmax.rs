//! Row-wise softmax in f64, max-subtracted: `y_i = exp(x_i - max) / sum_j exp(x_j - max)`.
//!
//! Rows are consecutive `cols`-element slices. Subtracting the row maximum keeps every
//! exponent <= 0, so nothing overflows and the largest term is exactly 1; the sum is
//! therefore >= 1 and the division is safe. A row of `-inf` except one finite value
//! gives a one-hot row; a row that is all `-inf` is a caller error (NaN out).

/// Softmax of each `cols`-element row of `x`.
///
/// Panics if `cols` is zero or does not divide `x.len()`.
pub fn softmax(x: &[f32], cols: usize) -> Vec<f64> {
    assert!(cols > 0, "cols is zero");
    assert_eq!(
        x.len() % cols,
        0,
        "x has {} elements, not a multiple of {cols}",
        x.len()
    );
    x.chunks(cols)
        .flat_map(|row| softmax_row(row.iter().map(|&v| v as f64)))
        .collect()
}

/// Softmax of one row given as f64 values.
pub fn softmax_row(row: impl Iterator<Item = f64> + Clone) -> Vec<f64> {
    let max = row.clone().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = row.map(|v| (v - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_to_one_and_are_shift_invariant() {
        let y = softmax(&[1.0, 2.0, 3.0, 1001.0, 1002.0, 1003.0], 3);
        for row in y.chunks(3) {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-15);
        }
        for i in 0..3 {
            assert!((y[i] - y[i + 3]).abs() < 1e-15);
        }
    }

    #[test]
    fn negative_infinity_gets_zero_weight() {
        assert_eq!(softmax(&[f32::NEG_INFINITY, 0.0], 2), vec![0.0, 1.0]);
    }
}
