//! Choosing the next token from a row of logits on the host, as `kiln_core::sampling`
//! defines it and the device sampler (`kiln_kernels::sample`) draws it: greedy
//! (`temperature == 0`, ties to the lower id) or the exponential race over the tokens the
//! row's filters keep, with Philox draws keyed by the request's seed and the token's
//! position, so host and device draw the same token (up to rounding on near-ties); and the
//! verification of drafted tokens ([`verify`]) that keeps speculative decoding's output
//! distributed exactly as plain sampling's.
use kiln_core::rng::Rng;
use kiln_core::sampling::{exponential, sampling_words, SamplingRow};

use crate::scheduler::TokenLogprobs;

/// The tokens `row` keeps, with their weights `exp((l - max) / temperature)` (logits
/// clamped to +-f32::MAX, NaN never kept; in descending logit order, ties by id, when a
/// filter applies), and the weights' sum. `row` must be sampled.
fn kept(logits: &[f32], row: &SamplingRow) -> (Vec<(u32, f64)>, f64) {
    let l = |i: usize| logits[i].clamp(-f32::MAX, f32::MAX) as f64;
    let numbers: Vec<usize> = (0..logits.len()).filter(|&i| !logits[i].is_nan()).collect();
    let Some(max) = numbers.iter().map(|&i| l(i)).reduce(f64::max) else {
        return (Vec::new(), 0.0);
    };
    let t = row.temperature as f64;
    let mut weights: Vec<(u32, f64)> = numbers
        .iter()
        .map(|&i| (i as u32, ((l(i) - max) / t).exp()))
        .collect();
    if !row.filters() {
        let total = weights.iter().map(|w| w.1).sum();
        return (weights, total);
    }
    let all: f64 = weights.iter().map(|w| w.1).sum();
    // Only tokens of weight at least `floor` can be kept once those already number top_k,
    // hold top_p of the mass (every lighter token has them all above it) or floor is under
    // min_p: sort those alone (a model's peaked rows keep few of 163,840).
    let mut floor = 1.0f64;
    loop {
        let (count, mass) = (weights.iter().filter(|w| w.1 >= floor))
            .fold((0usize, 0.0f64), |(c, m), w| (c + 1, m + w.1));
        let enough = (row.top_k > 0 && count >= row.top_k as usize)
            || (row.top_p < 1.0 && mass >= row.top_p as f64 * all)
            || floor <= row.min_p as f64;
        if enough || floor == 0.0 {
            break;
        }
        floor = if floor < 1e-300 { 0.0 } else { floor / 16.0 };
    }
    weights.retain(|w| w.1 >= floor);
    weights.sort_by(|a, b| {
        l(b.0 as usize)
            .total_cmp(&l(a.0 as usize))
            .then(a.0.cmp(&b.0))
    });
    // Every filter drops a suffix of this order, ties together: keep runs of equal logits
    // while the count and mass above them pass.
    let (mut end, mut mass) = (0, 0.0);
    while end < weights.len() {
        let w = weights[end].1;
        let keeps = (row.top_k == 0 || end < row.top_k as usize)
            && (row.top_p >= 1.0 || mass < row.top_p as f64 * all)
            && w >= row.min_p as f64;
        if !keeps {
            break;
        }
        let run = weights[end..]
            .iter()
            .take_while(|x| l(x.0 as usize) == l(weights[end].0 as usize))
            .count();
        mass += w * run as f64;
        end += run;
    }
    weights.truncate(end.max(1));
    let total = weights.iter().map(|w| w.1).sum();
    (weights, total)
}

/// The next token of one logits row.
pub fn sample(logits: &[f32], row: &SamplingRow) -> u32 {
    if !row.is_sampled() {
        return argmax(logits);
    }
    let (kept, _) = kept(logits, row);
    let max = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| l.clamp(-f32::MAX, f32::MAX) as f64)
        .fold(f64::MIN, f64::max);
    let mut best: Option<(f64, u32)> = None;
    for &(i, _) in &kept {
        let words = sampling_words(row.seed, row.position, i / 4);
        let e = exponential(words[i as usize % 4]) as f64;
        let l = logits[i as usize].clamp(-f32::MAX, f32::MAX) as f64;
        let key = (l - max) / row.temperature as f64 - e.ln();
        if best.is_none_or(|(b, at)| key > b || (key == b && i < at)) {
            best = Some((key, i));
        }
    }
    best.map_or(0, |b| b.1)
}

/// `token`'s log-probability in `logits` (log-softmax of the raw logits, NaN as no
/// probability) and the `top` most likely tokens' (ties to the lower id).
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let numbers = || logits.iter().map(|&l| l as f64).filter(|l| !l.is_nan());
    let max = numbers().fold(f64::NEG_INFINITY, f64::max);
    let log_total = max + numbers().map(|l| (l - max).exp()).sum::<f64>().ln();
    let of = |l: f32| match l.is_nan() {
        true => f32::NEG_INFINITY,
        false => (l as f64 - log_total) as f32,
    };
    let mut best: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| !logits[i as usize].is_nan())
        .collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let top = top.min(best.len());
    if top > 0 && top < best.len() {
        best.select_nth_unstable_by(top - 1, by_logit);
    }
    best.truncate(top);
    best.sort_by(by_logit);
    TokenLogprobs {
        logprob: of(logits[token as usize]),
        top: best
            .into_iter()
            .map(|i| (i, of(logits[i as usize])))
            .collect(),
    }
}

/// Verification of a draft tree node's children (their tokens, in the order tried)
/// against the row of logits at the node: `Ok(k)` keeps child `k`; `Err(t)` rejects them
/// all, `t` being the token emitted instead.
///
/// Lossless for drafters that propose tokens, not distributions (point masses): greedy
/// keeps the child that is the argmax; otherwise child `d` is kept with probability
/// `r(d)`, `r` being the kept distribution with the rejected children's tokens removed and
/// renormalised (the residual `max(r - q, 0)` of a point mass), and after the last
/// rejection a token is drawn from `r`; so the emitted token is distributed exactly as
/// [`sample`] draws it (Leviathan et al. 2023 for one child; SpecInfer's multi-round form
/// for several). Its uniforms come from the request's sequential `rng`.
pub fn verify(
    logits: &[f32],
    children: &[u32],
    row: &SamplingRow,
    rng: &mut Rng,
) -> Result<usize, u32> {
    if !row.is_sampled() {
        let best = argmax(logits);
        return children.iter().position(|&c| c == best).ok_or(best);
    }
    let (mut weights, mut total) = kept(logits, row);
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
    use kiln_reference::sampling::{distribution, draw as oracle_draw};
    use kiln_reference::stats::{chi_square, critical_value_p001};
    use proptest::prelude::{any, prop, prop_assert_eq, prop_oneof, proptest, Just};

    fn sampled(temperature: f32, top_p: f32, top_k: u32, min_p: f32) -> SamplingRow {
        SamplingRow {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: 3,
            position: 0,
        }
    }

    /// Counts of the tokens drawn at positions `0..n`.
    fn counts(logits: &[f32], row: SamplingRow, n: u32) -> Vec<usize> {
        let mut counts = vec![0; logits.len()];
        for position in 0..n {
            counts[sample(logits, &SamplingRow { position, ..row }) as usize] += 1;
        }
        counts
    }

    #[test]
    fn logprobs_are_the_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let l = logprobs(&logits, 4, 3);
        let total: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|x| x.exp()).sum();
        assert!((l.logprob as f64 - (-2.0 - total.ln())).abs() < 1e-6);
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0], "ties to the lower id, NaN never listed");
        assert!((l.top[0].1 as f64 - (3.0 - total.ln())).abs() < 1e-6);
        assert_eq!(logprobs(&logits, 2, 9).logprob, f32::NEG_INFINITY);
        assert_eq!(logprobs(&logits, 2, 9).top.len(), 4);
        assert!(logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn zero_temperature_is_greedy_with_ties_to_the_lower_id() {
        assert_eq!(sample(&[0.5, 2.0, 2.0, -1.0], &SamplingRow::greedy()), 1);
    }

    #[test]
    fn draws_follow_the_filtered_softmax() {
        // Probabilities 0.4, 0.3, 0.2, 0.1: top_p 0.85 keeps the first three (0.7 < 0.85);
        // top_k 2 the first two; min_p 0.3 those of at least 0.12.
        let logits = [0.4f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        for row in [
            sampled(1.0, 1.0, 0, 0.0),
            sampled(1.0, 0.85, 0, 0.0),
            sampled(1.0, 1.0, 2, 0.0),
            sampled(1.0, 1.0, 0, 0.3),
            sampled(0.6, 0.95, 3, 0.05),
        ] {
            let counts = counts(&logits, row, 40_000);
            let fit = chi_square(&counts, &distribution(&logits, &row));
            assert_eq!(fit.impossible, 0, "{row:?}: {counts:?}");
            assert!(
                fit.statistic < critical_value_p001(fit.dof),
                "{row:?}: {counts:?} {fit:?}"
            );
        }
    }

    #[test]
    fn a_token_depends_on_seed_and_position_only() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let row = sampled(0.8, 0.9, 0, 0.0);
        let run = |seed| {
            (0..20)
                .map(|position| {
                    sample(
                        &logits,
                        &SamplingRow {
                            seed,
                            position,
                            ..row
                        },
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    proptest! {
        /// The host draws the oracle's token wherever its race is not a near-tie (both
        /// compute keys in f64 from the same draws).
        #[test]
        fn host_draws_are_the_definitions(
            logits in prop::collection::vec(-8.0f32..8.0, 1..300),
            temperature in 0.05f32..2.0,
            top_p in prop_oneof![Just(1.0f32), 0.05f32..1.0],
            top_k in prop_oneof![Just(0u32), 1u32..30],
            min_p in prop_oneof![Just(0.0f32), 0.0f32..0.5],
            seed in any::<u64>(),
            position in any::<u32>(),
        ) {
            let row = SamplingRow { temperature, top_p, top_k, min_p, seed, position };
            let want = oracle_draw(&logits, &row);
            if want.margin > 1e-9 {
                prop_assert_eq!(sample(&logits, &row), want.token);
            }
        }
    }

    #[test]
    fn verified_drafts_emit_exactly_the_sampled_distribution() {
        // Drafts of every token and pair of tokens (siblings in a tree), likely and
        // unlikely, in full, under a nucleus that keeps three of the five
        // (0.4 + 0.25 < 0.8) and under top-k 2.
        let probs = [0.4f64, 0.25, 0.2, 0.1, 0.05];
        let logits: Vec<f32> = probs.iter().map(|&p| (p as f32).ln()).collect();
        let singles = (0..5u32).map(|d| vec![d]);
        let pairs = [vec![4, 0], vec![1, 3], vec![2, 1], vec![3, 4]];
        let drafts: Vec<Vec<u32>> = singles.chain(pairs).collect();
        for row in [
            sampled(1.0, 1.0, 0, 0.0),
            sampled(1.0, 0.8, 0, 0.0),
            sampled(1.0, 1.0, 2, 0.0),
        ] {
            let want = distribution(&logits, &row);
            for (i, children) in drafts.iter().enumerate() {
                let mut rng = Rng::new(13 + i as u64);
                let mut counts = [0usize; 5];
                for _ in 0..40_000 {
                    let t = match verify(&logits, children, &row, &mut rng) {
                        Ok(k) => children[k],
                        Err(t) => t,
                    };
                    counts[t as usize] += 1;
                }
                let fit = chi_square(&counts, &want);
                assert_eq!(fit.impossible, 0, "not kept: {counts:?}");
                assert!(
                    fit.statistic < critical_value_p001(fit.dof),
                    "draft {children:?} {row:?}: {counts:?} {fit:?}"
                );
            }
        }
        let mut rng = Rng::new(1);
        let greedy = SamplingRow::greedy();
        assert_eq!(verify(&logits, &[0], &greedy, &mut rng), Ok(0));
        assert_eq!(verify(&logits, &[2, 0], &greedy, &mut rng), Ok(1));
        assert_eq!(verify(&logits, &[2], &greedy, &mut rng), Err(0));
    }
}
