//! Choosing the next token from a row of logits: greedy (`temperature == 0`, ties to the
//! lower id) or a draw from `softmax(logits / temperature)`, restricted to the nucleus
//! (the most probable tokens whose probabilities reach `top_p`), with a seeded generator so
//! a run is reproducible; and the verification of drafted tokens ([`verify`]) that keeps
//! speculative decoding's output distributed exactly as plain sampling's.
use kiln_core::rng::Rng;

/// The distribution a row of logits is sampled from: `(token, weight)` pairs (weights not
/// normalised; their sum is returned), the nucleus only when `top_p < 1`. `temperature`
/// must be positive.
fn distribution(logits: &[f32], temperature: f32, top_p: f32) -> (Vec<(u32, f64)>, f64) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut weights: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l as f64 - max) / temperature as f64).exp()))
        .collect();
    let mut total: f64 = weights.iter().map(|w| w.1).sum();
    if top_p < 1.0 {
        weights.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut kept, mut mass) = (0, 0.0);
        while kept < weights.len() && mass < top_p as f64 * total {
            mass += weights[kept].1;
            kept += 1;
        }
        weights.truncate(kept.max(1));
        total = mass.max(weights[0].1);
    }
    (weights, total)
}

/// A draw from `weights` (summing to `total`).
fn draw(weights: &[(u32, f64)], total: f64, rng: &mut Rng) -> Option<u32> {
    let mut target = rng.uniform() * total;
    for &(i, w) in weights {
        if target < w {
            return Some(i);
        }
        target -= w;
    }
    weights.iter().rev().find(|w| w.1 > 0.0).map(|w| w.0)
}

/// The next token of one logits row.
pub fn sample(logits: &[f32], temperature: f32, top_p: f32, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let (weights, total) = distribution(logits, temperature, top_p);
    draw(&weights, total, rng).unwrap_or_else(|| argmax(logits))
}

/// Verification of a draft tree node's children (their tokens, in the order tried)
/// against the row of logits at the node: `Ok(k)` keeps child `k`; `Err(t)` rejects them
/// all, `t` being the token emitted instead.
///
/// Lossless for drafters that propose tokens, not distributions (point masses): greedy
/// keeps the child that is the argmax; otherwise child `d` is kept with probability
/// `r(d)`, `r` being `p` with the rejected children's tokens removed and renormalised (the
/// residual `max(r - q, 0)` of a point mass), and after the last rejection a token is
/// drawn from `r`; so the emitted token is distributed exactly as [`sample`] draws it
/// (Leviathan et al. 2023 for one child; SpecInfer's multi-round form for several).
pub fn verify(
    logits: &[f32],
    children: &[u32],
    temperature: f32,
    top_p: f32,
    rng: &mut Rng,
) -> Result<usize, u32> {
    if temperature <= 0.0 {
        let best = argmax(logits);
        return children.iter().position(|&c| c == best).ok_or(best);
    }
    let (mut weights, mut total) = distribution(logits, temperature, top_p);
    for (k, &child) in children.iter().enumerate() {
        let w = weights.iter().find(|w| w.0 == child).map_or(0.0, |w| w.1);
        if rng.uniform() * total < w {
            return Ok(k);
        }
        weights.retain(|w| w.0 != child);
        total -= w;
    }
    Err(draw(&weights, total, rng).unwrap_or_else(|| argmax(logits)))
}

/// Index of the largest logit, the lowest index on ties, never a NaN (0 if all are), as
/// the device's `kiln_kernels::argmax` chooses.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_nan() && best.is_none_or(|b| l > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_reference::stats::{chi_square, critical_value_p001};

    #[test]
    fn zero_temperature_is_greedy_with_ties_to_the_lower_id() {
        let mut rng = Rng::new(1);
        assert_eq!(sample(&[0.5, 2.0, 2.0, -1.0], 0.0, 1.0, &mut rng), 1);
    }

    #[test]
    fn sampling_follows_the_softmax() {
        let mut rng = Rng::new(7);
        let logits = [0.0f32, 1.0f32.ln(), 2.0f32.ln()]; // probabilities 1/4, 1/4, 1/2
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            counts[sample(&logits, 1.0, 1.0, &mut rng) as usize] += 1;
        }
        let fit = chi_square(&counts, &[0.25, 0.25, 0.5]);
        assert!(
            fit.statistic < critical_value_p001(fit.dof),
            "{counts:?}: {fit:?}"
        );
    }

    #[test]
    fn top_p_draws_only_from_the_nucleus_in_proportion() {
        let mut rng = Rng::new(11);
        // Probabilities 0.4, 0.3, 0.2, 0.1: top_p 0.85 keeps the first three (0.9 >= 0.85).
        let logits = [0.4f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            let t = sample(&logits, 1.0, 0.85, &mut rng) as usize;
            assert!(t < 3, "token {t} is outside the nucleus");
            counts[t] += 1;
        }
        let fit = chi_square(&counts, &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0]);
        assert!(
            fit.statistic < critical_value_p001(fit.dof),
            "{counts:?}: {fit:?}"
        );
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..20)
                .map(|_| sample(&logits, 0.8, 0.9, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
    }

    #[test]
    fn verified_drafts_emit_exactly_the_sampled_distribution() {
        // Drafts of every token and pair of tokens (siblings in a tree), likely and
        // unlikely, in full and under a nucleus that keeps three of the five
        // (0.4 + 0.25 + 0.2 >= 0.8).
        let probs = [0.4f64, 0.25, 0.2, 0.1, 0.05];
        let logits: Vec<f32> = probs.iter().map(|&p| (p as f32).ln()).collect();
        let nucleus = [0.4 / 0.85, 0.25 / 0.85, 0.2 / 0.85, 0.0, 0.0];
        let singles = (0..5u32).map(|d| vec![d]);
        let pairs = [vec![4, 0], vec![1, 3], vec![2, 1], vec![3, 4]];
        let drafts: Vec<Vec<u32>> = singles.chain(pairs).collect();
        for (top_p, want) in [(1.0, probs), (0.8, nucleus)] {
            for (i, children) in drafts.iter().enumerate() {
                let mut rng = Rng::new(13 + i as u64);
                let mut counts = [0usize; 5];
                for _ in 0..40_000 {
                    let t = match verify(&logits, children, 1.0, top_p, &mut rng) {
                        Ok(k) => children[k],
                        Err(t) => t,
                    };
                    counts[t as usize] += 1;
                }
                let fit = chi_square(&counts, &want);
                assert_eq!(fit.impossible, 0, "outside the nucleus: {counts:?}");
                assert!(
                    fit.statistic < critical_value_p001(fit.dof),
                    "draft {children:?} top_p {top_p}: {counts:?} {fit:?}"
                );
            }
        }
        let mut rng = Rng::new(1);
        assert_eq!(verify(&logits, &[0], 0.0, 1.0, &mut rng), Ok(0));
        assert_eq!(verify(&logits, &[2, 0], 0.0, 1.0, &mut rng), Ok(1));
        assert_eq!(verify(&logits, &[2], 0.0, 1.0, &mut rng), Err(0));
    }
}
