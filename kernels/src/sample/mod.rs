//! Sampling each row of logits on the device, as `kiln_core::sampling` defines it: greedy
//! rows take the argmax; sampled rows run the exponential race over the tokens their
//! filters (top-k, top-p, min-p) keep, drawing from Philox keyed by the row's seed and
//! position. Only the token ids leave the device. Oracle: `kiln_reference::sampling`.
//!
//! One cube per row. Without sorting, the kept set is found by rejection, as FlashInfer's
//! samplers do, but with one set of draws: a first pass takes the row's maximum and
//! softmax normaliser (online) and the race's winner over every token; while the winner
//! fails a filter (a second pass counts the tokens above it and their mass), every token
//! not above it fails too, so the race is rerun over the tokens above it. The winner that
//! passes is the race's winner over the kept set, which is the definition. Each rerun
//! strictly raises the bar, so the loop ends; for the peaked rows a model emits the first
//! winner usually passes (one pass, or two with filters).
//!
//! Parameters outside their ranges (top_p <= 0, min_p > 1) cannot hang a cube: when no
//! token is left above the bar, the last winner stands.
mod feed;
mod logprobs;
mod mask;

use cubecl::prelude::*;
use kiln_core::sampling::SAMPLING_WORDS;

pub use feed::feed_tokens;
pub use logprobs::{token_logprobs, MAX_TOP, NO_TOKEN};
pub use mask::{mask_logits, NO_MASK};

use crate::argmax::{check_rows, row_argmax, UNITS};
use crate::buffer::{check_index_space, check_len};
use crate::reduce::{cube_best, cube_sum};
use crate::{DeviceArray, KernelError};

/// An index no row has: "no winner".
const NONE: u32 = u32::MAX;
/// Philox4x32's multipliers and key increments (`kiln_core::philox`).
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// `out[r]` = the token row `r` of `logits` (`[rows, vocab]`) draws under its parameters,
/// `params[r * SAMPLING_WORDS..]` as `SamplingRow::words` lays them out.
pub fn sample_rows<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &DeviceArray<f32>,
    rows: usize,
    vocab: usize,
    params: &DeviceArray<u32>,
    out: &DeviceArray<u32>,
) -> Result<(), KernelError> {
    // Philox counts blocks of four tokens in one word, and NONE is no token.
    check_rows(client, rows, vocab, NONE as usize - 4)?;
    check_len("logits", logits, rows * vocab)?;
    check_len("sampling parameters", params, rows * SAMPLING_WORDS)?;
    check_len("sampled tokens", out, rows)?;
    check_index_space("logits", rows * vocab)?;
    // SAFETY: lengths checked above.
    unsafe {
        sample_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(UNITS),
            logits.arg(),
            params.arg(),
            out.arg(),
            vocab as u32,
        )
    }
    Ok(())
}

/// One row's parameters and the row's maximum and normaliser once known.
#[derive(CubeType)]
struct Row {
    base: usize,
    vocab: usize,
    inv_t: f32,
    position: u32,
    key0: u32,
    key1: u32,
    /// The row's largest number and `sum exp((l - max) * inv_t)`.
    max: f32,
    total: f32,
}

#[cube(launch_unchecked)]
fn sample_kernel(logits: &Array<f32>, params: &Array<u32>, out: &mut Array<u32>, vocab: u32) {
    let r = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let p = r * SAMPLING_WORDS;
    let temperature = f32::reinterpret(params[p]);
    let mut values = SharedMemory::<f32>::new(UNITS as usize);
    let mut indices = SharedMemory::<u32>::new(UNITS as usize);
    let mut counts = SharedMemory::<u32>::new(UNITS as usize);
    let base = r * vocab as usize;
    let token = if temperature > 0.0 {
        sampled(
            logits,
            params,
            p,
            base,
            vocab as usize,
            &mut values,
            &mut indices,
            &mut counts,
            unit,
        )
    } else {
        row_argmax(
            logits,
            base,
            vocab as usize,
            unit,
            &mut values,
            &mut indices,
        )
    };
    if unit == 0 {
        out[r] = token;
    }
}

/// The token a sampled row (temperature > 0) draws: the first race, then reruns above each
/// winner a filter drops.
#[cube]
#[allow(clippy::too_many_arguments)]
fn sampled(
    logits: &Array<f32>,
    params: &Array<u32>,
    p: usize,
    base: usize,
    vocab: usize,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
    counts: &mut SharedMemory<u32>,
    unit: usize,
) -> u32 {
    let mut row = Row {
        base,
        vocab,
        inv_t: 1.0 / f32::reinterpret(params[p]),
        position: params[p + 6],
        key0: params[p + 4],
        key1: params[p + 5],
        max: f32::new(f32::MIN),
        total: 0.0,
    };
    let mut token = first_race(logits, &mut row, values, indices, unit);
    let top_p = f32::reinterpret(params[p + 1]);
    let top_k = params[p + 2];
    let min_p = f32::reinterpret(params[p + 3]);
    let filtered = top_p < 1.0 || top_k > 0 || min_p > 0.0;
    let mut done = token == NONE || !filtered;
    while !done {
        let bar = logit(logits, base + token as usize);
        let mut kept = ((bar - row.max) * row.inv_t).exp() >= min_p;
        if kept && (top_k > 0 || top_p < 1.0) {
            let mut count = 0u32;
            let mut mass = 0.0f32;
            for j in range_stepped(unit, row.vocab, UNITS as usize) {
                let raw = logits[base + j];
                let l = clamped(raw);
                if !raw.is_nan() && l > bar {
                    count += 1;
                    mass += ((l - row.max) * row.inv_t).exp();
                }
            }
            let count = cube_sum(count, counts, unit, UNITS);
            let mass = cube_sum(mass, values, unit, UNITS);
            kept = (top_k == 0 || count < top_k) && (top_p >= 1.0 || mass < top_p * row.total);
        }
        if kept {
            done = true;
        } else {
            let next = race_above(logits, &row, bar, min_p, values, indices, unit);
            done = next == NONE;
            token = select(done, token, next);
        }
    }
    select(token == NONE, 0u32, token)
}

/// A logit as the sampler reads it: clamped to +-f32::MAX (NaN is tested apart).
#[cube]
fn clamped(raw: f32) -> f32 {
    max(min(raw, f32::new(f32::MAX)), f32::new(f32::MIN))
}

#[cube]
fn logit(logits: &Array<f32>, at: usize) -> f32 {
    clamped(logits[at])
}

/// The first pass: the row's maximum and normaliser into `row`, and the race's winner
/// over every number (`NONE` for a row of NaN). Each unit keeps its keys relative to its
/// running maximum, then to the row's.
#[cube]
fn first_race(
    logits: &Array<f32>,
    row: &mut Row,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
    unit: usize,
) -> u32 {
    let none = u32::new(NONE as i64);
    let mut m = f32::new(f32::MIN);
    let mut total = 0.0f32;
    let mut best_l = 0.0f32;
    let mut best_g = 0.0f32;
    let mut best_key = 0.0f32;
    let mut best_at = none;
    let mut words = Array::<u32>::new(4usize);
    let blocks = row.vocab.div_ceil(4);
    for block in range_stepped(unit, blocks, UNITS as usize) {
        philox(block as u32, row.position, row.key0, row.key1, &mut words);
        #[unroll]
        for i in 0..4 {
            let j = block * 4 + i;
            if j < row.vocab {
                let raw = logits[row.base + j];
                if !raw.is_nan() {
                    let l = clamped(raw);
                    if l > m {
                        total *= ((m - l) * row.inv_t).exp();
                        best_key = (best_l - l) * row.inv_t + best_g;
                        m = l;
                    }
                    total += ((l - m) * row.inv_t).exp();
                    let g = -exponential(words[i]).ln();
                    let key = (l - m) * row.inv_t + g;
                    if better_key(key, j as u32, best_key, best_at) {
                        best_key = key;
                        best_l = l;
                        best_g = g;
                        best_at = j as u32;
                    }
                }
            }
        }
    }
    // The row's maximum and normaliser: pairs combined on a common maximum.
    values[unit] = m;
    sync_cube();
    let levels = comptime!(UNITS.trailing_zeros());
    for level in 0..levels {
        let stride = (UNITS as usize) >> (level + 1) as usize;
        if unit < stride {
            values[unit] = max(values[unit], values[unit + stride]);
        }
        sync_cube();
    }
    row.max = values[0];
    sync_cube();
    let scaled = total * ((m - row.max) * row.inv_t).exp();
    row.total = cube_sum(scaled, values, unit, UNITS);
    let key = (best_l - row.max) * row.inv_t + best_g;
    cube_best(key, best_at, values, indices, unit, none, UNITS)
}

/// The race's winner among the numbers above `bar` that min-p keeps, with the same draws
/// as [`first_race`]; `NONE` if there are none.
#[cube]
fn race_above(
    logits: &Array<f32>,
    row: &Row,
    bar: f32,
    min_p: f32,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
    unit: usize,
) -> u32 {
    let none = u32::new(NONE as i64);
    let mut best_key = 0.0f32;
    let mut best_at = none;
    let mut words = Array::<u32>::new(4usize);
    let blocks = row.vocab.div_ceil(4);
    for block in range_stepped(unit, blocks, UNITS as usize) {
        philox(block as u32, row.position, row.key0, row.key1, &mut words);
        #[unroll]
        for i in 0..4 {
            let j = block * 4 + i;
            if j < row.vocab {
                let raw = logits[row.base + j];
                let l = clamped(raw);
                let scaled = (l - row.max) * row.inv_t;
                if !raw.is_nan() && l > bar && scaled.exp() >= min_p {
                    let key = scaled - exponential(words[i]).ln();
                    if better_key(key, j as u32, best_key, best_at) {
                        best_key = key;
                        best_at = j as u32;
                    }
                }
            }
        }
    }
    cube_best(best_key, best_at, values, indices, unit, none, UNITS)
}

/// A key beats the unit's best: none yet, larger, or equal at a lower index (a unit's
/// indices ascend, so equal keys keep the first).
#[cube]
fn better_key(key: f32, at: u32, best: f32, best_at: u32) -> bool {
    best_at == u32::new(NONE as i64) || key > best || (key == best && at < best_at)
}

/// `kiln_core::sampling::exponential` of 32 random bits.
#[cube]
fn exponential(bits: u32) -> f32 {
    let v = (f32::cast_from(bits) + 0.5) * f32::new(1.0 / 4_294_967_296.0);
    let series = v * (1.0 + v * (0.5 + v * f32::new(1.0 / 3.0)));
    let log = -(1.0 - v).ln();
    select(v < f32::new(1.0 / 128.0), series, log)
}

/// `kiln_core::philox::philox4x32_10([block, position, 0, 0], [key0, key1])` into `words`.
#[cube]
fn philox(block: u32, position: u32, key0: u32, key1: u32, words: &mut Array<u32>) {
    let m0 = u32::new(M0 as i64);
    let m1 = u32::new(M1 as i64);
    let mut c0 = block;
    let mut c1 = position;
    let mut c2 = 0u32;
    let mut c3 = 0u32;
    let mut k0 = key0;
    let mut k1 = key1;
    #[unroll]
    for _ in 0..10 {
        let hi0 = u32::mul_hi(m0, c0);
        let lo0 = m0 * c0;
        let hi1 = u32::mul_hi(m1, c2);
        let lo1 = m1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += u32::new(W0 as i64);
        k1 += u32::new(W1 as i64);
    }
    words[0] = c0;
    words[1] = c1;
    words[2] = c2;
    words[3] = c3;
}
