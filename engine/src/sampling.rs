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

/// Verification of one drafted token against the row of logits at its position:
/// `Ok(())` keeps it; `Err(t)` rejects it, `t` being the token emitted instead.
///
/// Lossless for a drafter that proposes one token (a point mass): greedy keeps the draft
/// iff it is the argmax; otherwise the draft `d` is kept with probability `p(d)` and a
/// rejection draws from `p` with `d` removed (the residual `max(p - q, 0)` renormalised),
/// so each emitted token is distributed exactly as [`sample`] would draw it (Leviathan et
/// al. 2023, Chen et al. 2023).
pub fn verify(
    logits: &[f32],
    draft: u32,
    temperature: f32,
    top_p: f32,
    rng: &mut Rng,
) -> Result<(), u32> {
    if temperature <= 0.0 {
        let best = argmax(logits);
        return if best == draft { Ok(()) } else { Err(best) };
    }
    let (mut weights, total) = distribution(logits, temperature, top_p);
    let p = weights.iter().find(|w| w.0 == draft).map_or(0.0, |w| w.1) / total;
    if rng.uniform() < p {
        return Ok(());
    }
    weights.retain(|w| w.0 != draft);
    let rest = total - p * total;
    Err(draw(&weights, rest, rng).unwrap_or_else(|| argmax(logits)))
}

/// Index of the largest logit, the lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
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
        // Drafts of every token, likely and unlikely, in full and under a nucleus that
        // keeps three of the five (0.4 + 0.25 + 0.2 >= 0.8).
        let probs = [0.4f64, 0.25, 0.2, 0.1, 0.05];
        let logits: Vec<f32> = probs.iter().map(|&p| (p as f32).ln()).collect();
        let nucleus = [0.4 / 0.85, 0.25 / 0.85, 0.2 / 0.85, 0.0, 0.0];
        for (top_p, want) in [(1.0, probs), (0.8, nucleus)] {
            for draft in 0..5u32 {
                let mut rng = Rng::new(13 + draft as u64);
                let mut counts = [0usize; 5];
                for _ in 0..40_000 {
                    let t = verify(&logits, draft, 1.0, top_p, &mut rng)
                        .err()
                        .unwrap_or(draft);
                    counts[t as usize] += 1;
                }
                let fit = chi_square(&counts, &want);
                assert_eq!(fit.impossible, 0, "outside the nucleus: {counts:?}");
                assert!(
                    fit.statistic < critical_value_p001(fit.dof),
                    "draft {draft} top_p {top_p}: {counts:?} {fit:?}"
                );
            }
        }
        let mut rng = Rng::new(1);
        assert_eq!(verify(&logits, 0, 0.0, 1.0, &mut rng), Ok(()));
        assert_eq!(verify(&logits, 2, 0.0, 1.0, &mut rng), Err(0));
    }
}
