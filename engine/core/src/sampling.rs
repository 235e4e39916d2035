//! What one row of logits is sampled with, shared by the device sampler
//! (`kiln_kernels::sample`), the host sampler (`kiln::sampling`) and their oracle
//! (`kiln_reference::sampling`).
//!
//! A row keeps the tokens that pass every filter on `softmax(logits / temperature)`
//! (SGLang's joint filtering, each filter on the whole distribution): `top_k` (fewer than
//! `top_k` tokens have a larger logit), `top_p` (the probability of the tokens with a larger
//! logit is below `top_p`) and `min_p` (its probability is at least `min_p` times the
//! largest). Tied logits are kept or dropped together. The draw from what is kept is the
//! exponential race (the Gumbel-max trick): the kept token with the largest
//! `(logit - max) / temperature - ln(E)` wins, `E` an [`exponential`] variate from
//! Philox keyed by the request's seed and the drawn token's position ([`sampling_words`]).
//! So a token depends on its request's seed, its position and its row alone, never on the
//! batch. Logits are clamped to +-f32::MAX (infinities act as the extreme numbers) and NaN
//! is never drawn; a row with no number gives 0.
use crate::philox::philox4x32_10;

/// How one row is sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingRow {
    /// 0 (or below) is greedy: the argmax, ties to the lowest id.
    pub temperature: f32,
    /// In `(0, 1]`; 1 keeps every token.
    pub top_p: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    /// In `[0, 1]`; 0 keeps every token.
    pub min_p: f32,
    /// The request's seed.
    pub seed: u64,
    /// Position of the token drawn (its index in the request's sequence).
    pub position: u32,
}

/// Words per row of the device sampler's parameters ([`SamplingRow::words`]).
pub const SAMPLING_WORDS: usize = 8;

impl SamplingRow {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        SamplingRow {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
            position: 0,
        }
    }

    /// Whether this row draws at random.
    pub fn is_sampled(&self) -> bool {
        self.temperature > 0.0
    }

    /// Whether a filter may drop tokens.
    pub fn filters(&self) -> bool {
        self.top_p < 1.0 || self.top_k > 0 || self.min_p > 0.0
    }

    /// The row as the device sampler reads it: temperature, top_p, top_k, min_p (floats as
    /// their bits), the seed's low and high halves, the position and a zero.
    pub fn words(&self) -> [u32; SAMPLING_WORDS] {
        [
            self.temperature.to_bits(),
            self.top_p.to_bits(),
            self.top_k,
            self.min_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.position,
            0,
        ]
    }
}

/// The four random words of a sampling draw: those of tokens `4 * block .. 4 * block + 4`
/// of the row drawn for the token at `position` of the request seeded `seed`. Philox's
/// counter is `[block, position, 0, 0]` (the last two words are free for other streams of
/// the same request), its key the seed's two halves.
pub fn sampling_words(seed: u64, position: u32, block: u32) -> [u32; 4] {
    philox4x32_10([block, position, 0, 0], [seed as u32, (seed >> 32) as u32])
}

/// An exponential variate (rate 1) from 32 random bits: `-ln(1 - v)`, `v` uniform in
/// `(0, 1)` with `v = (bits + 1/2) / 2^32` rounded to f32 (full relative precision near 0,
/// where the draws that win a race are). Below 2^-7 the series `v + v^2/2 + v^3/3` (relative
/// error under 2^-23) replaces the logarithm, whose argument would lose `v`'s low bits.
/// The sampling kernel computes the same expression.
pub fn exponential(bits: u32) -> f32 {
    let v = (bits as f32 + 0.5) * (1.0 / 4_294_967_296.0);
    if v < 1.0 / 128.0 {
        v * (1.0 + v * (0.5 + v * (1.0 / 3.0)))
    } else {
        -(1.0 - v).ln()
    }
}

/// `logits` with the tokens `allowed` does not allow at minus infinity: bit `t % 32` of
/// word `t / 32` allows token `t`; tokens past the words are not allowed. What a grammar's
/// mask does to a row (`kiln_kernels::sample::mask_logits` on the device).
pub fn masked(logits: &[f32], allowed: &[u32]) -> Vec<f32> {
    (logits.iter().enumerate())
        .map(|(t, &l)| {
            let bit = allowed.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
            if bit {
                l
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_variates_have_mean_and_tail_of_rate_one() {
        let n = 1 << 18;
        let draws: Vec<f64> = (0..n / 4)
            .flat_map(|b| sampling_words(5, 17, b))
            .map(|w| exponential(w) as f64)
            .collect();
        assert!(draws.iter().all(|&e| e > 0.0 && e.is_finite()));
        let mean = draws.iter().sum::<f64>() / n as f64;
        assert!((mean - 1.0).abs() < 0.01, "mean {mean}");
        // P(E > 2) = e^-2; P(E < 0.01) = 1 - e^-0.01 (the winners' end).
        let above = draws.iter().filter(|&&e| e > 2.0).count() as f64 / n as f64;
        let small = draws.iter().filter(|&&e| e < 0.01).count() as f64 / n as f64;
        assert!((above - (-2.0f64).exp()).abs() < 0.003, "{above}");
        assert!((small - (1.0 - (-0.01f64).exp())).abs() < 0.001, "{small}");
        // Continuous across the switch to the series.
        let at = |v: f64| exponential((v * 4_294_967_296.0) as u32) as f64;
        let edge = 1.0 / 128.0;
        assert!((at(edge * 0.9999) - at(edge * 1.0001)).abs() < 1e-5);
        assert!((at(edge) + (1.0 - edge).ln()).abs() < 1e-6);
    }

    #[test]
    fn draws_differ_by_seed_position_and_block() {
        let base = sampling_words(1, 2, 3);
        for other in [
            sampling_words(2, 2, 3),
            sampling_words(1 << 32 | 1, 2, 3),
            sampling_words(1, 3, 3),
            sampling_words(1, 2, 4),
        ] {
            assert_ne!(base, other);
        }
        assert_eq!(base, sampling_words(1, 2, 3));
    }
}
