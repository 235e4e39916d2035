//! Choosing the next token from a row of logits: greedy (`temperature == 0`, ties to the
//! lower id) or a draw from `softmax(logits / temperature)`, restricted to the nucleus
//! (the most probable tokens whose probabilities reach `top_p`), with a seeded generator so
//! a run is reproducible.
use kiln_core::rng::Rng;

/// The next token of one logits row.
pub fn sample(logits: &[f32], temperature: f32, top_p: f32, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
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
    let mut target = rng.uniform() * total;
    for &(i, w) in &weights {
        if target < w {
            return i;
        }
        target -= w;
    }
    weights.last().map_or_else(|| argmax(logits), |w| w.0)
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
}
