//! Deterministic test data: the value distributions kernel tests draw from, over the
//! seeded generator [`Rng`] (xoshiro256**, `kiln_core::rng`). The same seed gives the same
//! data on every platform, so a failing case is reproduced by its seed alone. Test
//! tensors never contain exact zeros (a zero hides sign, scale and indexing bugs).

pub use kiln_core::rng::Rng;

/// `n` values of `normal() * scale`, with about 1% of them multiplied by 16 (the
/// outliers real activations and weights have), and exact zeros replaced by
/// `scale * 2^-10` so that no test runs on zeros.
///
/// Panics if `scale` is zero or not finite.
pub fn normal_with_outliers(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    assert!(
        scale != 0.0 && scale.is_finite(),
        "scale must be finite and nonzero"
    );
    (0..n)
        .map(|_| {
            let mut v = (rng.normal() * scale as f64) as f32;
            if rng.uniform() < 0.01 {
                v *= 16.0;
            }
            if v == 0.0 {
                v = scale / 1024.0;
            }
            v
        })
        .collect()
}

/// Index drawn with probability proportional to `probs` (non-negative, not all
/// zero). Never returns an index whose weight is zero.
pub fn categorical(rng: &mut Rng, probs: &[f64]) -> usize {
    let total: f64 = probs.iter().sum();
    assert!(total > 0.0, "categorical needs some positive weight");
    let target = rng.uniform() * total;
    let mut acc = 0.0;
    for (i, &p) in probs.iter().enumerate() {
        acc += p;
        if acc > target && p > 0.0 {
            return i;
        }
    }
    // Rounding left the target at or above the final cumulative sum.
    probs.iter().rposition(|&p| p > 0.0).unwrap()
}

/// A random probability vector of length `n`: each entry is zero with probability
/// `zero_share` (at least one entry stays positive), the rest are Dirichlet(1)
/// weights. Sums to 1 up to f32 rounding.
///
/// Panics if `n == 0`.
pub fn random_distribution(rng: &mut Rng, n: usize, zero_share: f64) -> Vec<f32> {
    assert!(n > 0, "empty distribution");
    let mut w: Vec<f64> = (0..n)
        .map(|_| {
            let zero = rng.uniform() < zero_share;
            // -ln(U) with U in (0, 1] is Exp(1); normalized Exp(1) draws are Dirichlet(1).
            let weight = -(1.0 - rng.uniform()).ln();
            if zero {
                0.0
            } else {
                weight
            }
        })
        .collect();
    if w.iter().all(|&x| x == 0.0) {
        w[rng.below(n)] = 1.0;
    }
    let total: f64 = w.iter().sum();
    w.iter().map(|&x| (x / total) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outlier_data_has_no_zeros_and_some_outliers() {
        let mut rng = Rng::new(11);
        let v = normal_with_outliers(&mut rng, 100_000, 0.5);
        assert!(v.iter().all(|&x| x != 0.0 && x.is_finite()));
        let big = v.iter().filter(|x| x.abs() > 4.0).count();
        assert!(big > 300 && big < 1500, "{big}");
    }

    #[test]
    fn distributions_sum_to_one_and_respect_zeros() {
        let mut rng = Rng::new(5);
        for _ in 0..100 {
            let p = random_distribution(&mut rng, 9, 0.5);
            let sum: f64 = p.iter().map(|&x| x as f64).sum();
            assert!((sum - 1.0).abs() < 1e-6);
            assert!(p.iter().any(|&x| x > 0.0));
            let p64: Vec<f64> = p.iter().map(|&x| x as f64).collect();
            for _ in 0..20 {
                assert!(p[categorical(&mut rng, &p64)] > 0.0);
            }
        }
    }
}
