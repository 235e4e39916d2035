//! Choosing the next token from a row of logits: greedy (`temperature == 0`, ties to the
//! lower id) or a draw from `softmax(logits / temperature)` with a seeded generator, so a
//! run is reproducible.
use kiln_reference::data::Rng;

/// The next token of one logits row.
pub fn sample(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max) / temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = rng.uniform() * total;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i as u32;
        }
        target -= w;
    }
    argmax(logits)
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
        assert_eq!(sample(&[0.5, 2.0, 2.0, -1.0], 0.0, &mut rng), 1);
    }

    #[test]
    fn sampling_follows_the_softmax() {
        let mut rng = Rng::new(7);
        let logits = [0.0f32, 1.0f32.ln(), 2.0f32.ln()]; // probabilities 1/4, 1/4, 1/2
        let mut counts = [0usize; 3];
        for _ in 0..40_000 {
            counts[sample(&logits, 1.0, &mut rng) as usize] += 1;
        }
        let fit = chi_square(&counts, &[0.25, 0.25, 0.5]);
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
                .map(|_| sample(&logits, 0.8, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
    }
}
