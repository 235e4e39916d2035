//! Sampling a row of logits as `kiln_core::sampling` defines it, by the definition: the
//! kept set from a sort, probabilities in f64, the exponential race as a plain argmax over
//! the kept tokens' keys. The oracle of the device sampler (`kiln_kernels::sample`), which
//! finds the same winner without sorting.
use crate::argmax::argmax_rows;
use kiln_core::sampling::{exponential, sampling_words};
pub use kiln_core::sampling::{masked, SamplingRow};

/// The row's logits as the sampler reads them: clamped to +-f32::MAX, NaN as `None`.
fn clamped(logits: &[f32]) -> Vec<Option<f64>> {
    logits
        .iter()
        .map(|&l| (!l.is_nan()).then(|| l.clamp(-f32::MAX, f32::MAX) as f64))
        .collect()
}

/// `(max logit, each token's unnormalised probability exp((l - max) / temperature))`, or
/// `None` for a row with no number. `temperature` must be positive.
fn weights(logits: &[f32], temperature: f32) -> Option<(f64, Vec<f64>)> {
    let l = clamped(logits);
    let max = l.iter().flatten().copied().reduce(f64::max)?;
    let t = temperature as f64;
    let w = l
        .iter()
        .map(|x| x.map_or(0.0, |x| ((x - max) / t).exp()))
        .collect();
    Some((max, w))
}

/// Which tokens `row`'s filters keep (every number when the row is greedy or unfiltered).
pub fn kept(logits: &[f32], row: &SamplingRow) -> Vec<bool> {
    let l = clamped(logits);
    let Some((_, w)) = weights(logits, row.temperature.max(f32::MIN_POSITIVE)) else {
        return vec![false; logits.len()];
    };
    let total: f64 = w.iter().sum();
    // Descending logits; for each token, the count and mass of strictly larger ones.
    let mut order: Vec<usize> = (0..l.len()).filter(|&i| l[i].is_some()).collect();
    order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap());
    let mut keep = vec![false; l.len()];
    let (mut above, mut mass) = (0usize, 0.0f64);
    let mut i = 0;
    while i < order.len() {
        // A run of tied logits shares the count and mass above it.
        let mut j = i;
        while j < order.len() && l[order[j]] == l[order[i]] {
            j += 1;
        }
        let tokens = &order[i..j];
        let w_tok = w[tokens[0]];
        let in_k = row.top_k == 0 || above < row.top_k as usize;
        let in_p = row.top_p >= 1.0 || mass < row.top_p as f64 * total;
        let in_min = row.min_p <= 0.0 || w_tok >= row.min_p as f64;
        for &t in tokens {
            keep[t] = in_k && in_p && in_min;
        }
        above += tokens.len();
        mass += w_tok * tokens.len() as f64;
        i = j;
    }
    keep
}

/// The probability of each token under `row`: a point mass at the argmax when greedy,
/// else the softmax at the row's temperature over the kept tokens, renormalised.
pub fn distribution(logits: &[f32], row: &SamplingRow) -> Vec<f64> {
    let mut p = vec![0.0; logits.len()];
    if !row.is_sampled() {
        p[argmax_rows(logits, logits.len())[0] as usize] = 1.0;
        return p;
    }
    let Some((_, w)) = weights(logits, row.temperature) else {
        p[0] = 1.0;
        return p;
    };
    let keep = kept(logits, row);
    let total: f64 = (0..w.len()).filter(|&i| keep[i]).map(|i| w[i]).sum();
    for i in 0..w.len() {
        if keep[i] {
            p[i] = w[i] / total;
        }
    }
    p
}

/// A drawn token and how far its race was from a tie: the gap between its key and the
/// runner-up's among the kept tokens (infinite when it ran alone; 0 when greedy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    pub token: u32,
    pub margin: f64,
}

/// Each kept token's key in the race, `(l - max) / temperature - ln(E)`, or `None`.
pub fn keys(logits: &[f32], row: &SamplingRow) -> Vec<Option<f64>> {
    let Some((max, _)) = weights(logits, row.temperature) else {
        return vec![None; logits.len()];
    };
    let keep = kept(logits, row);
    let l = clamped(logits);
    (0..logits.len())
        .map(|i| {
            let words = sampling_words(row.seed, row.position, (i / 4) as u32);
            let e = exponential(words[i % 4]) as f64;
            keep[i].then(|| (l[i].unwrap() - max) / row.temperature as f64 - e.ln())
        })
        .collect()
}

/// The token `row` draws from `logits`.
pub fn draw(logits: &[f32], row: &SamplingRow) -> Draw {
    if !row.is_sampled() {
        let token = argmax_rows(logits, logits.len())[0];
        return Draw { token, margin: 0.0 };
    }
    let keys = keys(logits, row);
    let mut ranked: Vec<(usize, f64)> = keys
        .iter()
        .enumerate()
        .filter_map(|(i, k)| k.map(|k| (i, k)))
        .collect();
    // Largest key first, the lower id first among equal keys.
    ranked.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    match ranked.as_slice() {
        [] => Draw {
            token: 0,
            margin: f64::INFINITY,
        },
        [(t, _)] => Draw {
            token: *t as u32,
            margin: f64::INFINITY,
        },
        [(t, a), (_, b), ..] => Draw {
            token: *t as u32,
            margin: a - b,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{chi_square, critical_value_p001};

    fn row(temperature: f32, top_p: f32, top_k: u32, min_p: f32) -> SamplingRow {
        SamplingRow {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: 7,
            position: 0,
        }
    }

    #[test]
    fn filters_keep_what_their_definitions_say() {
        // Probabilities 0.4, 0.2, 0.2, 0.1, 0.1 (two ties).
        let logits: Vec<f32> = [0.4f32, 0.2, 0.2, 0.1, 0.1]
            .iter()
            .map(|p| p.ln())
            .collect();
        let k = |r| kept(&logits, &r);
        assert_eq!(k(row(1.0, 1.0, 0, 0.0)), [true; 5]);
        // Two tokens beat the tied pair at 0.1: top_k 2 keeps the first three (tie kept).
        assert_eq!(k(row(1.0, 1.0, 2, 0.0)), [true, true, true, false, false]);
        assert_eq!(k(row(1.0, 1.0, 1, 0.0)), [true, false, false, false, false]);
        // 0.4 above the pair at 0.2: kept at top_p 0.5, dropped at 0.4.
        assert_eq!(k(row(1.0, 0.5, 0, 0.0)), [true, true, true, false, false]);
        assert_eq!(k(row(1.0, 0.4, 0, 0.0)), [true, false, false, false, false]);
        // min_p 0.45: at least 0.18 (0.2 / 0.4 may round either side of 0.5).
        assert_eq!(k(row(1.0, 1.0, 0, 0.45)), [true, true, true, false, false]);
        // Filters combine: every one must pass.
        assert_eq!(k(row(1.0, 0.5, 1, 0.0)), [true, false, false, false, false]);
        let d = distribution(&logits, &row(1.0, 0.5, 0, 0.0));
        assert!((d[0] - 0.5).abs() < 1e-6 && (d[1] - 0.25).abs() < 1e-6 && d[3] == 0.0);
    }

    #[test]
    fn nan_is_never_kept_and_infinities_are_extremes() {
        let logits = [
            f32::NAN,
            f32::INFINITY,
            0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let d = distribution(&logits, &row(1.0, 1.0, 0, 0.0));
        assert_eq!(d, vec![0.0, 0.5, 0.0, 0.5, 0.0]);
        let nan = [f32::NAN; 3];
        assert_eq!(draw(&nan, &row(1.0, 0.9, 0, 0.0)).token, 0);
        assert_eq!(distribution(&nan, &row(1.0, 0.9, 0, 0.0))[0], 1.0);
        assert_eq!(draw(&[1.0, 3.0, 3.0], &SamplingRow::greedy()).token, 1);
    }

    #[test]
    fn the_race_over_positions_follows_the_distribution() {
        let logits: Vec<f32> = (0..9).map(|i| (i as f32 * 0.9).sin() * 2.0).collect();
        for r in [
            row(0.7, 1.0, 0, 0.0),
            row(1.3, 0.8, 0, 0.0),
            row(1.0, 1.0, 4, 0.1),
        ] {
            let want = distribution(&logits, &r);
            let mut counts = vec![0usize; 9];
            for position in 0..20_000 {
                let t = draw(&logits, &SamplingRow { position, ..r }).token;
                counts[t as usize] += 1;
            }
            let fit = chi_square(&counts, &want);
            assert_eq!(fit.impossible, 0, "{r:?}: {counts:?}");
            assert!(
                fit.statistic < critical_value_p001(fit.dof),
                "{r:?}: {fit:?}"
            );
        }
    }
}

/// Log-probabilities by the definition: `token`'s log-softmax of the raw logits (in f64;
/// NaN has no probability: minus infinity) and the `top` most likely tokens' (by logit,
/// ties to the lower id), from a full sort. The oracle of
/// `kiln_kernels::sample::token_logprobs`.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> (f64, Vec<(u32, f64)>) {
    let numbers: Vec<f64> = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| l as f64)
        .collect();
    let max = numbers.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let log_total = max + numbers.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
    let of = |l: f32| match l.is_nan() {
        true => f64::NEG_INFINITY,
        false => l as f64 - log_total,
    };
    let mut order: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    order.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    let best = order
        .into_iter()
        .take(top)
        .map(|i| (i, of(logits[i as usize])))
        .collect();
    let chosen = logits
        .get(token as usize)
        .map_or(f64::NEG_INFINITY, |&l| of(l));
    (chosen, best)
}
