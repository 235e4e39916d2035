//! The distributions a workload draws its sizes and gaps from.
//!
//! Agent traffic is heavy-tailed: most tool results are short, some are whole files;
//! most tool calls return in well under a second, a few take minutes. Each quantity is a
//! log-normal given by its mean and shape (`sigma`, the standard deviation of its log),
//! clamped to `[min, max]` so that one draw can't exceed what an agent would send (a file
//! read truncated at 40k tokens, a user who answers within 15 minutes). The mean of the
//! clamped variable is known in closed form ([`Dist::mean`]), so tests compare sample
//! means against it exactly rather than against the unclamped parameter.
//!
//! Invariants: samples are finite and in `[min, max]`; `sigma = 0` is a constant.
use kiln_core::rng::Rng;
use serde::{Deserialize, Serialize};

/// A clamped log-normal distribution, parametrised by the mean before clamping.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Mean of the log-normal before clamping.
    pub mean: f64,
    /// Standard deviation of `ln X`: 0 is a constant, 1 a tail of about 10x the median at
    /// p99, 1.5 about 30x.
    pub sigma: f64,
    /// Smallest value a sample takes.
    pub min: f64,
    /// Largest value a sample takes.
    pub max: f64,
}

impl Dist {
    /// A log-normal with the given mean and shape, clamped to `[min, max]`.
    pub const fn log_normal(mean: f64, sigma: f64, min: f64, max: f64) -> Self {
        Self {
            mean,
            sigma,
            min,
            max,
        }
    }

    /// A constant.
    pub const fn constant(value: f64) -> Self {
        Self::log_normal(value, 0.0, value, value)
    }

    /// `mu` of the underlying normal: `ln(mean) - sigma^2 / 2`.
    fn mu(&self) -> f64 {
        self.mean.ln() - self.sigma * self.sigma / 2.0
    }

    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> f64 {
        let x = (self.mu() + self.sigma * rng.normal()).exp();
        x.clamp(self.min, self.max)
    }

    /// One draw rounded to a whole count of at least `floor`.
    pub fn sample_count(&self, rng: &mut Rng, floor: u32) -> u32 {
        (self.sample(rng).round() as u32).max(floor)
    }

    /// Exact mean of the clamped variable:
    /// `min P(X < min) + E[X; min <= X <= max] + max P(X > max)`, with
    /// `E[X; X <= c] = mean * Phi((ln c - mu - sigma^2) / sigma)`.
    pub fn mean(&self) -> f64 {
        if self.sigma == 0.0 {
            return self.mean.clamp(self.min, self.max);
        }
        let (mu, s) = (self.mu(), self.sigma);
        let z = |c: f64| (c.ln() - mu) / s;
        let below_min = normal_cdf(z(self.min));
        let above_max = 1.0 - normal_cdf(z(self.max));
        let partial = |c: f64| self.mean * normal_cdf(z(c) - s);
        self.min * below_min + (partial(self.max) - partial(self.min)) + self.max * above_max
    }

    /// Exact variance of the clamped variable, from its second moment
    /// `E[X^2; X <= c] = exp(2 mu + 2 sigma^2) Phi((ln c - mu - 2 sigma^2) / sigma)`.
    /// Tests use it for the standard error of a sample mean: with a heavy tail the
    /// sample's own variance underestimates it.
    pub fn variance(&self) -> f64 {
        if self.sigma == 0.0 {
            return 0.0;
        }
        let (mu, s) = (self.mu(), self.sigma);
        let z = |c: f64| (c.ln() - mu) / s;
        let below_min = normal_cdf(z(self.min));
        let above_max = 1.0 - normal_cdf(z(self.max));
        let partial = |c: f64| (2.0 * mu + 2.0 * s * s).exp() * normal_cdf(z(c) - 2.0 * s);
        let second = self.min * self.min * below_min
            + (partial(self.max) - partial(self.min))
            + self.max * self.max * above_max;
        (second - self.mean().powi(2)).max(0.0)
    }

    /// The same shape with every value multiplied by `factor` (mean, min and max).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            mean: self.mean * factor,
            sigma: self.sigma,
            min: self.min * factor,
            max: self.max * factor,
        }
    }

    /// The same shape scaled by `factor`, with `min` at least `floor` (token counts stay
    /// whole and positive when a context is shrunk for a small model).
    pub fn scaled_at_least(&self, factor: f64, floor: f64) -> Self {
        let mut d = self.scaled(factor);
        d.min = d.min.max(floor);
        d.max = d.max.max(d.min);
        d.mean = d.mean.max(floor);
        d
    }
}

/// Standard normal CDF through `erfc` (Numerical Recipes' Chebyshev fit, relative error
/// below 1.2e-7 everywhere), accurate enough for expected means in tests.
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * erfc(-z / std::f64::consts::SQRT_2)
}

fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_cdf_matches_known_quantiles() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_964) - 0.975).abs() < 1e-6);
        assert!((normal_cdf(-2.326_348) - 0.01).abs() < 1e-6);
    }

    #[test]
    fn unclamped_mean_is_the_parameter() {
        let d = Dist::log_normal(500.0, 1.0, 1e-9, 1e12);
        assert!((d.mean() - 500.0).abs() < 1e-3, "{}", d.mean());
    }

    #[test]
    fn unclamped_variance_is_the_log_normal_one() {
        let d = Dist::log_normal(500.0, 1.0, 1e-9, 1e12);
        let want = 500.0f64.powi(2) * (1.0f64.exp() - 1.0);
        assert!((d.variance() / want - 1.0).abs() < 1e-4, "{}", d.variance());
    }

    #[test]
    fn clamped_moments_match_a_large_sample() {
        let d = Dist::log_normal(10.0, 1.2, 2.0, 40.0);
        let mut rng = Rng::new(3);
        let xs: Vec<f64> = (0..200_000).map(|_| d.sample(&mut rng)).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            (mean / d.mean() - 1.0).abs() < 0.01,
            "{mean} vs {}",
            d.mean()
        );
        assert!(
            (var / d.variance() - 1.0).abs() < 0.03,
            "{var} vs {}",
            d.variance()
        );
    }

    #[test]
    fn clamping_the_tail_lowers_the_mean() {
        let d = Dist::log_normal(500.0, 1.5, 1.0, 2000.0);
        assert!(d.mean() < 500.0 && d.mean() > 300.0, "{}", d.mean());
    }

    #[test]
    fn constant_always_returns_its_value() {
        let mut rng = Rng::new(1);
        let d = Dist::constant(7.0);
        assert!((0..100).all(|_| d.sample(&mut rng) == 7.0));
        assert_eq!(d.mean(), 7.0);
    }

    #[test]
    fn samples_stay_within_the_clamp() {
        let mut rng = Rng::new(2);
        let d = Dist::log_normal(10.0, 2.0, 3.0, 50.0);
        assert!((0..10_000)
            .map(|_| d.sample(&mut rng))
            .all(|x| (3.0..=50.0).contains(&x)));
    }
}
