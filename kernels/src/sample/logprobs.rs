//! Log-probabilities on the device: each row's chosen token's log-softmax of the raw
//! logits (as OpenAI and vLLM report it, whatever the sampling temperature) and its `top`
//! most likely tokens (ties to the lower id), so a request that asks for them reads back
//! `1 + 2 * top` numbers a row instead of the row. NaN logits have no probability.
//! Oracle: `kiln_reference::sampling::logprobs`.
//!
//! One cube per row: the row's maximum, then its normaliser, then `top` rounds of the
//! cube's best among the tokens below the last one taken (by logit, then id).
use cubecl::prelude::*;

use crate::argmax::{check_rows, UNITS};
use crate::buffer::{check_index_space, check_len};
use crate::reduce::{cube_best, cube_sum};
use crate::{DeviceArray, KernelError};

/// Most alternatives a row may list (OpenAI's `top_logprobs` limit is 20).
pub const MAX_TOP: usize = 32;
/// The id of a missing alternative (a row with fewer numbers than `top`).
pub const NO_TOKEN: u32 = u32::MAX;

/// Row `r`'s log-probability of `tokens[r]` into `token_lp[r]`, and its `top` (1 to
/// [`MAX_TOP`]) most likely tokens and theirs into `top_ids[r * top..]` and `top_lp[r * top..]` (descending; a row
/// with fewer numbers ends in [`NO_TOKEN`] at minus infinity).
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &DeviceArray<f32>,
    rows: usize,
    vocab: usize,
    tokens: &DeviceArray<u32>,
    top: usize,
    token_lp: &DeviceArray<f32>,
    top_ids: &DeviceArray<u32>,
    top_lp: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    check_rows(client, rows, vocab, NO_TOKEN as usize - 1)?;
    // At least one alternative: no buffer is empty (a backend may skip a launch that
    // binds one).
    if !(1..=MAX_TOP).contains(&top) {
        return Err(KernelError::Range {
            what: "top logprobs",
            value: top,
            min: 1,
            max: MAX_TOP,
        });
    }
    check_len("logits", logits, rows * vocab)?;
    check_len("tokens", tokens, rows)?;
    check_len("token log-probabilities", token_lp, rows)?;
    check_len("top ids", top_ids, rows * top)?;
    check_len("top log-probabilities", top_lp, rows * top)?;
    check_index_space("logits", rows * vocab)?;
    // SAFETY: lengths checked above; a token id past the row is read as no probability.
    unsafe {
        logprobs_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(UNITS),
            logits.arg(),
            tokens.arg(),
            token_lp.arg(),
            top_ids.arg(),
            top_lp.arg(),
            vocab as u32,
            top as u32,
            f32::NEG_INFINITY,
        )
    }
    Ok(())
}

#[cube(launch_unchecked)]
fn logprobs_kernel(
    logits: &Array<f32>,
    tokens: &Array<u32>,
    token_lp: &mut Array<f32>,
    top_ids: &mut Array<u32>,
    top_lp: &mut Array<f32>,
    vocab: u32,
    top: u32,
    // Minus infinity as an argument: WGSL refuses non-finite constants in a shader.
    neg_inf: f32,
) {
    let r = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let vocab = vocab as usize;
    let base = r * vocab;
    let none = u32::new(NO_TOKEN as i64);
    let mut values = SharedMemory::<f32>::new(UNITS as usize);
    let mut indices = SharedMemory::<u32>::new(UNITS as usize);
    // The row's maximum.
    let mut best = f32::new(f32::MIN);
    let mut best_at = none;
    for j in range_stepped(unit, vocab, UNITS as usize) {
        let l = logits[base + j];
        if !l.is_nan() && (best_at == none || l > best) {
            best = l;
            best_at = j as u32;
        }
    }
    let at = cube_best(best, best_at, &mut values, &mut indices, unit, none, UNITS);
    let max = select(
        at == none,
        0.0f32,
        logits[base + select(at == none, 0, at) as usize],
    );
    // The normaliser: log of the sum of exp(l - max).
    let mut total = 0.0f32;
    for j in range_stepped(unit, vocab, UNITS as usize) {
        let l = logits[base + j];
        if !l.is_nan() {
            total += (l - max).exp();
        }
    }
    let log_total = max + cube_sum(total, &mut values, unit, UNITS).ln();
    if unit == 0 {
        let t = tokens[r] as usize;
        let l = logits[base + select(t < vocab, t, 0)];
        token_lp[r] = select(l.is_nan() || t >= vocab, neg_inf, l - log_total);
    }
    // The `top` best, each the best of those after the last taken (by logit, then id).
    let mut last = 0.0f32;
    let mut last_at = none;
    for k in 0..top as usize {
        let mut best = 0.0f32;
        let mut best_at = none;
        for j in range_stepped(unit, vocab, UNITS as usize) {
            let l = logits[base + j];
            let after = last_at == none || l < last || (l == last && j as u32 > last_at);
            if !l.is_nan() && after && (best_at == none || l > best) {
                best = l;
                best_at = j as u32;
            }
        }
        let at = cube_best(best, best_at, &mut values, &mut indices, unit, none, UNITS);
        if at != none {
            last = logits[base + at as usize];
            last_at = at;
        }
        if unit == 0 {
            top_ids[r * top as usize + k] = at;
            top_lp[r * top as usize + k] = select(at == none, neg_inf, last - log_total);
        }
    }
}
