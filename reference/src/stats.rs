//! Goodness-of-fit statistics for the sampling tests (stochastic tree verification must
//! emit tokens distributed exactly as the target).
//!
//! Pearson's chi-square statistic over the cells the target gives mass to, and critical
//! values at p = 0.001 from the chi-square survival function, the regularized upper
//! incomplete gamma function `Q(dof/2, x/2)`, summed by its power series
//! `P(a, z) = z^a e^-z sum_n z^n / Gamma(a + n + 1)` (all terms positive; `Gamma` of
//! integers and half-integers by recurrence, exactly).

/// `ln Gamma(a + 1)` for `a` a positive multiple of 1/2.
fn ln_gamma_plus_one(a: f64) -> f64 {
    // Gamma(1) = 1, Gamma(3/2) = sqrt(pi) / 2, then Gamma(b + 1) = b Gamma(b).
    let (mut b, mut ln) = if a.fract() == 0.0 {
        (1.0, 0.0)
    } else {
        (1.5, (std::f64::consts::PI.sqrt() / 2.0).ln())
    };
    while b < a + 1.0 - 1e-9 {
        ln += b.ln();
        b += 1.0;
    }
    ln
}

/// Survival function `P(X >= x)` of chi-square with `dof` (> 0) degrees of freedom.
pub fn chi_square_survival(x: f64, dof: usize) -> f64 {
    assert!(dof > 0, "chi-square needs a positive dof");
    if x <= 0.0 {
        return 1.0;
    }
    let (a, z) = (dof as f64 / 2.0, x / 2.0);
    let mut term = (a * z.ln() - z - ln_gamma_plus_one(a)).exp();
    let mut sum = 0.0;
    let mut n = 1.0;
    while term > sum * 1e-17 {
        sum += term;
        term *= z / (a + n);
        n += 1.0;
    }
    (1.0 - sum).max(0.0)
}

/// Critical value at p = 0.001 for `dof` in 1..=1000, found by bisection on
/// [`chi_square_survival`]. Panics outside that range.
pub fn critical_value_p001(dof: usize) -> f64 {
    assert!((1..=1000).contains(&dof), "no critical value for {dof} dof");
    let (mut lo, mut hi) = (0.0f64, 2000.0f64);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if chi_square_survival(mid, dof) > 0.001 {
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
    fn critical_values_match_the_closed_forms_and_tables() {
        // dof 2: exp(-x/2) = 0.001, so x = 2 ln 1000.
        assert!((critical_value_p001(2) - 2.0 * 1000f64.ln()).abs() < 1e-9);
        // dof 4: exp(-x/2) (1 + x/2) = 0.001 at x = 18.4668 (tables: 18.467).
        assert!((critical_value_p001(4) - 18.4668).abs() < 1e-4);
        // Odd dof against published tables (p = 0.001): 10.828, 16.266, 29.588, 148.230.
        for (dof, table) in [(1, 10.828), (3, 16.266), (9, 27.877), (99, 148.230)] {
            assert!((critical_value_p001(dof) - table).abs() < 2e-3, "{dof}");
        }
        assert!((critical_value_p001(10) - 29.588).abs() < 1e-3);
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
