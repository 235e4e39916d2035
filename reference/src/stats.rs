//! Goodness-of-fit statistics for the sampling tests (stochastic tree verification must
//! emit tokens distributed exactly as the target).
//!
//! Pearson's chi-square statistic over the cells the target gives mass to, and critical
//! values at p = 0.001 derived from the closed-form survival function for an even number
//! of degrees of freedom (`Q(x) = exp(-x/2) sum_{j<m} (x/2)^j / j!` for `2m` dof: the
//! Poisson-tail identity of the regularized upper incomplete gamma function).

/// Survival function `P(X >= x)` of chi-square with `dof` (even, > 0) degrees of freedom.
pub fn chi_square_survival_even(x: f64, dof: usize) -> f64 {
    assert!(
        dof.is_multiple_of(2) && dof > 0,
        "closed form needs an even dof, got {dof}"
    );
    let half = x / 2.0;
    let mut term = 1.0;
    let mut sum = 0.0;
    for j in 0..dof / 2 {
        if j > 0 {
            term *= half / j as f64;
        }
        sum += term;
    }
    (-half).exp() * sum
}

/// Critical value at p = 0.001 for an even `dof` (2, 4, ..., 20), found by bisection on
/// [`chi_square_survival_even`]. Panics on odd or out-of-range `dof`.
pub fn critical_value_p001(dof: usize) -> f64 {
    assert!(
        dof.is_multiple_of(2) && (2..=20).contains(&dof),
        "no critical value for {dof} dof"
    );
    let (mut lo, mut hi) = (0.0f64, 200.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if chi_square_survival_even(mid, dof) > 0.001 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// Outcome of a goodness-of-fit test of observed counts against probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct GoodnessOfFit {
    /// Pearson's statistic over the cells with positive probability.
    pub statistic: f64,
    /// Degrees of freedom: positive-probability cells minus one.
    pub dof: usize,
    /// Counts observed in cells of zero probability (must be 0 for a correct sampler).
    pub impossible: usize,
}

/// Pearson's chi-square of `counts` against `probs` (same length; `probs` sums to 1).
pub fn chi_square(counts: &[usize], probs: &[f64]) -> GoodnessOfFit {
    assert_eq!(
        counts.len(),
        probs.len(),
        "counts and probabilities differ in length"
    );
    let trials: usize = counts.iter().sum();
    let mut fit = GoodnessOfFit {
        statistic: 0.0,
        dof: 0,
        impossible: 0,
    };
    let mut cells = 0usize;
    for (&c, &p) in counts.iter().zip(probs) {
        if p == 0.0 {
            fit.impossible += c;
            continue;
        }
        let expected = p * trials as f64;
        fit.statistic += (c as f64 - expected).powi(2) / expected;
        cells += 1;
    }
    fit.dof = cells.saturating_sub(1);
    fit
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_values_match_the_closed_forms() {
        // dof 2: exp(-x/2) = 0.001, so x = 2 ln 1000.
        assert!((critical_value_p001(2) - 2.0 * 1000f64.ln()).abs() < 1e-9);
        // dof 4: exp(-x/2) (1 + x/2) = 0.001 at x = 18.4668 (tables: 18.467).
        assert!((critical_value_p001(4) - 18.4668).abs() < 1e-4);
    }

    #[test]
    fn a_perfect_fit_has_zero_statistic() {
        let fit = chi_square(&[25, 50, 25, 0], &[0.25, 0.5, 0.25, 0.0]);
        assert_eq!(
            fit,
            GoodnessOfFit {
                statistic: 0.0,
                dof: 2,
                impossible: 0
            }
        );
    }
}
