//! Sampling on the device against `kiln_reference::sampling`, on every backend: the same
//! token as the race by definition wherever the race is not a near-tie, the sampled
//! distribution by a chi-square test, the same token whatever the batch; outputs poisoned
//! before each launch.
use crate::cases::run_cases;
use cubecl::prelude::*;
use kiln_kernels::sample::{
    feed_tokens, mask_logits, sample_rows, token_logprobs, MAX_TOP, NO_MASK, NO_TOKEN,
};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::sampling::{distribution, draw, kept, logprobs, masked, SamplingRow};
use kiln_reference::stats::{chi_square, critical_value_p001};
use kiln_reference::tolerance::{gamma, DType};
use proptest::prelude::*;

const POISON: u32 = u32::MAX - 1;

/// The device's token for each row.
fn sample<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &[f32],
    vocab: usize,
    rows: &[SamplingRow],
) -> Vec<u32> {
    let params: Vec<u32> = rows.iter().flat_map(|r| r.words()).collect();
    let out = DeviceArray::filled(client, rows.len(), POISON);
    sample_rows(
        client,
        &DeviceArray::upload(client, logits),
        rows.len(),
        vocab,
        &DeviceArray::upload(client, &params),
        &out,
    )
    .unwrap();
    out.read(client)
}

/// Parameters of every kind: greedy, plain temperature, each filter and all of them.
fn params() -> impl Strategy<Value = SamplingRow> {
    let temperature = prop_oneof![Just(0.0f32), 0.05f32..2.0];
    let top_p = prop_oneof![Just(1.0f32), 0.05f32..1.0];
    let top_k = prop_oneof![Just(0u32), 1u32..40];
    let min_p = prop_oneof![Just(0.0f32), 0.0f32..0.5];
    (temperature, top_p, top_k, min_p, any::<u64>(), any::<u32>()).prop_map(
        |(temperature, top_p, top_k, min_p, seed, position)| SamplingRow {
            temperature,
            top_p,
            top_k,
            min_p,
            seed,
            position,
        },
    )
}

/// Rows of normal logits with outliers, some with ties, infinities and NaN.
fn logit_rows(rng: &mut Rng, rows: usize, vocab: usize) -> Vec<f32> {
    let mut x = normal_with_outliers(rng, rows * vocab, 2.0);
    for row in x.chunks_mut(vocab) {
        match rng.below(4) {
            0 => {
                let v = row[rng.below(vocab)];
                row[rng.below(vocab)] = v;
            }
            1 => {
                row[rng.below(vocab)] = f32::NAN;
                row[rng.below(vocab)] = f32::NEG_INFINITY;
            }
            _ => {}
        }
    }
    x
}

/// Whether `row`'s kept set is the same with its thresholds nudged both ways (the device
/// sums the mass in another order and in f32, so a token on a threshold may go either way).
fn kept_is_stable(logits: &[f32], row: &SamplingRow) -> bool {
    let nudged = |f: f32| SamplingRow {
        top_p: if row.top_p < 1.0 {
            (row.top_p * f).min(1.0)
        } else {
            1.0
        },
        min_p: row.min_p * f,
        ..*row
    };
    let want = kept(logits, row);
    kept(logits, &nudged(1.0 + 1e-4)) == want && kept(logits, &nudged(1.0 - 1e-4)) == want
}

/// The range of the kept tokens' logits (clamped as the sampler reads them).
fn key_span(logits: &[f32], keep: &[bool]) -> f64 {
    let kept = logits.iter().zip(keep).filter(|k| *k.1);
    let (lo, hi) = kept.fold((f64::MAX, f64::MIN), |(lo, hi), (&l, _)| {
        let l = l.clamp(-f32::MAX, f32::MAX) as f64;
        (lo.min(l), hi.max(l))
    });
    (hi - lo).max(0.0)
}

fn rows_draw_the_race_by_definition<R: Runtime>(client: &ComputeClient<R>) {
    let width = prop_oneof![1usize..=600, Just(163_840usize)];
    let rows = prop::collection::vec(params(), 1..=4);
    // (sampled rows, those compared token for token): near-ties and thresholds must stay rare.
    // About 97% of sampled rows compare exactly (472-491 rows a run, 2026-12-07); 96 cases
    // give the 90% floor about 115 rows, where 24 gave about 22, which fell to 19 by chance
    // in about 3% of runs.
    let compared = std::cell::Cell::new((0usize, 0usize));
    run_cases(96, &(width, rows, any::<u64>()), |(vocab, rows, seed)| {
        let mut rng = Rng::new(seed);
        let x = logit_rows(&mut rng, rows.len(), vocab);
        let got = sample(client, &x, vocab, &rows);
        for (i, row) in rows.iter().enumerate() {
            let logits = &x[i * vocab..(i + 1) * vocab];
            let want = draw(logits, row);
            let keep = kept(logits, row);
            let t = got[i] as usize;
            prop_assert!(t < vocab, "row {i}: token {t} of {vocab}");
            // The device's keys are f32 sums of (l - max) / T and -ln(E) (|ln E| < 18 for
            // any draw): each off by a few ulps of those terms' size.
            let span = key_span(logits, &keep) / row.temperature as f64;
            let tie = want.margin <= 64.0 * f32::EPSILON as f64 * (span + 18.0);
            let exact = !tie && kept_is_stable(logits, row);
            if row.is_sampled() {
                let (n, e) = compared.get();
                compared.set((n + 1, e + exact as usize));
            }
            if !row.is_sampled() || exact {
                prop_assert_eq!(got[i], want.token, "row {} {:?}", i, row);
            } else if !logits.iter().all(|l| l.is_nan()) {
                prop_assert!(
                    keep[t] || !kept_is_stable(logits, row),
                    "row {i}: token {t} is not kept under {row:?}"
                );
            }
        }
        Ok(())
    });
    let (sampled, exact) = compared.get();
    assert!(
        exact * 10 >= sampled * 9,
        "{exact} of {sampled} sampled rows compared exactly"
    );
}

fn draws_follow_the_distribution<R: Runtime>(client: &ComputeClient<R>) {
    let vocab = 13;
    let logits: Vec<f32> = (0..vocab).map(|i| (i as f32 * 1.7).sin() * 2.5).collect();
    let base = SamplingRow {
        temperature: 0.8,
        seed: 99,
        ..SamplingRow::greedy()
    };
    for row in [
        base,
        SamplingRow { top_p: 0.8, ..base },
        SamplingRow { top_k: 4, ..base },
        SamplingRow {
            min_p: 0.15,
            ..base
        },
        SamplingRow {
            temperature: 1.6,
            top_p: 0.9,
            top_k: 6,
            min_p: 0.05,
            ..base
        },
    ] {
        let draws = 4096;
        let rows: Vec<SamplingRow> = (0..draws)
            .map(|position| SamplingRow { position, ..row })
            .collect();
        let x: Vec<f32> = logits
            .iter()
            .copied()
            .cycle()
            .take(draws as usize * vocab)
            .collect();
        let mut counts = vec![0usize; vocab];
        for t in sample(client, &x, vocab, &rows) {
            counts[t as usize] += 1;
        }
        let fit = chi_square(&counts, &distribution(&logits, &row));
        assert_eq!(fit.impossible, 0, "{row:?}: {counts:?}");
        assert!(
            fit.statistic < critical_value_p001(fit.dof),
            "{row:?}: {counts:?} {fit:?}"
        );
    }
}

fn a_row_draws_the_same_token_in_any_batch<R: Runtime>(client: &ComputeClient<R>) {
    let vocab = 517;
    let mut rng = Rng::new(5);
    let x = logit_rows(&mut rng, 8, vocab);
    let rows: Vec<SamplingRow> = (0..8)
        .map(|i| SamplingRow {
            temperature: 0.5 + i as f32 * 0.2,
            top_p: if i % 2 == 0 { 0.9 } else { 1.0 },
            top_k: if i % 3 == 0 { 20 } else { 0 },
            seed: 1000 + i as u64,
            position: 40 + i,
            ..SamplingRow::greedy()
        })
        .collect();
    let together = sample(client, &x, vocab, &rows);
    for (i, row) in rows.iter().enumerate() {
        let alone = sample(client, &x[i * vocab..(i + 1) * vocab], vocab, &[*row]);
        assert_eq!(alone[0], together[i], "row {i}");
    }
    // Another position draws again.
    let moved: Vec<SamplingRow> = rows
        .iter()
        .map(|r| SamplingRow {
            position: r.position + 1,
            ..*r
        })
        .collect();
    assert_ne!(sample(client, &x, vocab, &moved), together);
}

fn rows_without_numbers_and_bad_shapes<R: Runtime>(client: &ComputeClient<R>) {
    let nan = [f32::NAN; 6];
    let sampled = SamplingRow {
        temperature: 1.0,
        top_p: 0.5,
        ..SamplingRow::greedy()
    };
    assert_eq!(
        sample(client, &nan, 3, &[sampled, SamplingRow::greedy()]),
        vec![0, 0]
    );
    // Out-of-range parameters still give a token.
    let odd = SamplingRow {
        top_p: 0.0,
        min_p: 2.0,
        ..sampled
    };
    let t = sample(client, &[0.5, 2.0, 1.0], 3, &[odd]);
    assert!(t[0] < 3, "{t:?}");
    let logits = DeviceArray::upload(client, &[0.0f32; 6]);
    let out = DeviceArray::filled(client, 2, POISON);
    let short = DeviceArray::upload(client, &sampled.words());
    let err = sample_rows(client, &logits, 2, 3, &short, &out);
    assert!(
        matches!(
            err,
            Err(KernelError::Length {
                what: "sampling parameters",
                ..
            })
        ),
        "{err:?}"
    );
    let err = sample_rows(client, &logits, 0, 6, &short, &out);
    assert!(
        matches!(err, Err(KernelError::Range { what: "rows", .. })),
        "{err:?}"
    );
}

/// The device's `(token log-probability, top ids, top log-probabilities)` of each row.
fn device_logprobs<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &[f32],
    vocab: usize,
    tokens: &[u32],
    top: usize,
) -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let rows = tokens.len();
    let (lp, ids, top_lp) = (
        DeviceArray::filled(client, rows, f32::NAN),
        DeviceArray::filled(client, rows * top, POISON),
        DeviceArray::filled(client, rows * top, f32::NAN),
    );
    token_logprobs(
        client,
        &DeviceArray::upload(client, logits),
        rows,
        vocab,
        &DeviceArray::upload(client, tokens),
        top,
        &lp,
        &ids,
        &top_lp,
    )
    .unwrap();
    (lp.read(client), ids.read(client), top_lp.read(client))
}

/// Log-probabilities as the definition gives them: the top ids exactly (ties to the lower
/// id), values within the f32 error of a `vocab`-term sum and the subtraction after it
/// (NaN on both sides for a row whose only numbers are minus infinity).
fn logprobs_are_the_definitions<R: Runtime>(client: &ComputeClient<R>) {
    let width = prop_oneof![1usize..=600, Just(163_840usize)];
    let cases = (width, 1usize..=4, 1usize..=MAX_TOP, any::<u64>());
    run_cases(16, &cases, |(vocab, rows, top, seed)| {
        let mut rng = Rng::new(seed);
        let x = logit_rows(&mut rng, rows, vocab);
        let tokens: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
        let (lp, ids, top_lp) = device_logprobs(client, &x, vocab, &tokens, top);
        for r in 0..rows {
            let row = &x[r * vocab..(r + 1) * vocab];
            let (want, best) = logprobs(row, tokens[r], top);
            let max = row
                .iter()
                .filter(|l| l.is_finite())
                .fold(0f32, |m, l| m.max(l.abs()));
            let close = |got: f32, want: f64| {
                let allowed = gamma(vocab, DType::F32)
                    + 8.0 * DType::F32.unit_roundoff() * (2.0 * max as f64 + want.abs() + 1.0);
                (got as f64 == want)
                    || (got.is_nan() && want.is_nan())
                    || (got as f64 - want).abs() <= allowed
            };
            prop_assert!(close(lp[r], want), "row {r}: {} against {want}", lp[r]);
            let got: Vec<u32> = ids[r * top..(r + 1) * top].to_vec();
            let mut want_ids: Vec<u32> = best.iter().map(|b| b.0).collect();
            want_ids.resize(top, NO_TOKEN);
            prop_assert_eq!(&got, &want_ids, "row {}", r);
            for (k, &(_, w)) in best.iter().enumerate() {
                let g = top_lp[r * top + k];
                prop_assert!(close(g, w), "row {r} top {k}: {g} against {w}");
            }
            for k in best.len()..top {
                prop_assert_eq!(top_lp[r * top + k], f32::NEG_INFINITY);
            }
        }
        Ok(())
    });
    let (_, ids, lp) = device_logprobs(client, &[f32::NAN, 1.0, f32::NAN], 3, &[0], 2);
    assert_eq!((ids, lp[1]), (vec![1, NO_TOKEN], f32::NEG_INFINITY));
    let logits = DeviceArray::upload(client, &[0.0f32; 3]);
    let one = DeviceArray::<u32>::filled(client, 1, 0);
    let f = DeviceArray::<f32>::filled(client, 64, 0.0);
    let u = DeviceArray::<u32>::filled(client, 64, 0);
    for top in [0, MAX_TOP + 1] {
        let err = token_logprobs(client, &logits, 1, 3, &one, top, &f, &u, &f);
        let refused = matches!(
            err,
            Err(KernelError::Range {
                what: "top logprobs",
                ..
            })
        );
        assert!(refused, "{err:?}");
    }
}

/// A step's input ids taken from the previous step's sampled tokens: each fed index gets
/// its row's token, every other index keeps what the host uploaded; more pairs than a
/// cube's units, rows read more than once, and out-of-range pairs refused.
fn fed_tokens_are_the_sampled_rows<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(1usize..=600, 1usize..=300, any::<u64>()),
        |(len, rows, seed)| {
            let mut rng = Rng::new(seed);
            let host: Vec<u32> = (0..len).map(|_| rng.below(1000) as u32).collect();
            let sampled: Vec<u32> = (0..rows).map(|_| 1000 + rng.below(1000) as u32).collect();
            let mut at: Vec<usize> = (0..len).filter(|_| rng.below(3) == 0).collect();
            // Distinct indices in any order.
            for i in (1..at.len()).rev() {
                at.swap(i, rng.below(i + 1));
            }
            let feeds: Vec<(usize, usize)> = at.iter().map(|&a| (a, rng.below(rows))).collect();
            let tokens = DeviceArray::upload(client, &host);
            let dev_sampled = DeviceArray::upload(client, &sampled);
            feed_tokens(client, &dev_sampled, &feeds, &tokens).unwrap();
            let mut expected = host.clone();
            for &(a, r) in &feeds {
                expected[a] = sampled[r];
            }
            prop_assert_eq!(tokens.read(client), expected);
            for bad in [(len, 0), (0, rows)] {
                let refused = feed_tokens(client, &dev_sampled, &[bad], &tokens);
                prop_assert!(matches!(refused, Err(KernelError::Range { .. })), "{bad:?}");
            }
            Ok(())
        },
    );
}

/// A grammar's masks on rows of logits: masked rows equal the oracle's (forbidden tokens at
/// minus infinity, the rest bit for bit, NaN and infinities kept), unmasked rows are copied,
/// two rows may share a mask, vocabularies that end mid-word; outputs poisoned first.
fn masked_rows_are_the_definition<R: Runtime>(client: &ComputeClient<R>) {
    run_cases(
        24,
        &(1usize..=6, 1usize..=300, 0usize..=3, any::<u64>()),
        |(rows, vocab, count, seed)| {
            let mut rng = Rng::new(seed);
            let logits = logit_rows(&mut rng, rows, vocab);
            let words = vocab.div_ceil(32);
            let masks: Vec<u32> = (0..count * words)
                .map(|_| match rng.below(4) {
                    0 => 0,
                    1 => u32::MAX,
                    _ => rng.next_u64() as u32,
                })
                .collect();
            let mask_of_row: Vec<u32> = (0..rows)
                .map(|_| match count {
                    0 => NO_MASK,
                    _ if rng.below(3) == 0 => NO_MASK,
                    _ => rng.below(count) as u32,
                })
                .collect();
            let out = DeviceArray::filled(client, rows * vocab, f32::NAN);
            let masks_dev = DeviceArray::upload(client, &masks);
            let logits_dev = DeviceArray::upload(client, &logits);
            mask_logits(
                client,
                &logits_dev,
                rows,
                vocab,
                &masks_dev,
                &mask_of_row,
                &out,
            )
            .unwrap();
            let got = out.read(client);
            for (r, &m) in mask_of_row.iter().enumerate() {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let want = match m {
                    NO_MASK => row.to_vec(),
                    m => masked(row, &masks[m as usize * words..(m as usize + 1) * words]),
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(
                    bits(&got[r * vocab..(r + 1) * vocab]),
                    bits(&want),
                    "row {}",
                    r
                );
            }
            let past = vec![count as u32; rows];
            let refused = mask_logits(client, &logits_dev, rows, vocab, &masks_dev, &past, &out);
            prop_assert!(
                matches!(refused, Err(KernelError::Range { .. })),
                "{refused:?}"
            );
            Ok(())
        },
    );
}

kiln_backends::backend_tests! {
    masked_rows_are_the_definition,
    fed_tokens_are_the_sampled_rows,
    logprobs_are_the_definitions,
    rows_draw_the_race_by_definition,
    draws_follow_the_distribution,
    a_row_draws_the_same_token_in_any_batch,
    rows_without_numbers_and_bad_shapes,
}
