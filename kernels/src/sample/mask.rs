//! Constrained rows on the device: a copy of a step's logits in which each masked row's
//! forbidden tokens (a clear bit in the row's allowed-token bitset) are minus infinity,
//! for the sampler to draw from; the raw rows stay for log-probabilities. What lets a
//! request under a grammar (a JSON schema, a forced tool call) send `vocab / 32` words a
//! step instead of reading its row of logits back.
use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError};

/// A row with no mask (every token allowed).
pub const NO_MASK: u32 = u32::MAX;

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn mask_kernel(
    logits: &Array<f32>,
    masks: &Array<u32>,
    mask_of_row: &Array<u32>,
    out: &mut Array<f32>,
    vocab: u32,
    words: u32,
    forbidden: f32,
) {
    let r = CUBE_POS_Y as usize;
    let t = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if t < vocab as usize {
        let at = r * vocab as usize + t;
        let m = mask_of_row[r];
        let mut allowed = m == u32::new(NO_MASK as i64);
        if !allowed {
            let word = masks[m as usize * words as usize + t / 32];
            allowed = (word >> (t % 32) as u32) & 1 == 1;
        }
        out[at] = select(allowed, logits[at], forbidden);
    }
}

/// `out` = `logits` (`[rows, vocab]`) with, in each row `r` whose `mask_of_row[r]` is a
/// mask's index `m` (not [`NO_MASK`]), the tokens whose bit is clear in
/// `masks[m * words..(m + 1) * words]` (`words = vocab.div_ceil(32)`, bit `t % 32` of word
/// `t / 32` for token `t`) at minus infinity.
pub fn mask_logits<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &DeviceArray<f32>,
    rows: usize,
    vocab: usize,
    masks: &DeviceArray<u32>,
    mask_of_row: &[u32],
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    let words = vocab.div_ceil(32);
    check_len("logits", logits, rows * vocab)?;
    check_len("masked logits", out, rows * vocab)?;
    if mask_of_row.len() != rows {
        return Err(KernelError::Length {
            what: "mask of each row",
            expected: rows,
            got: mask_of_row.len(),
        });
    }
    let count = masks.len() / words.max(1);
    if masks.len() != count * words {
        return Err(KernelError::Length {
            what: "masks (whole rows of words)",
            expected: count * words,
            got: masks.len(),
        });
    }
    if let Some(&m) = mask_of_row
        .iter()
        .find(|&&m| m != NO_MASK && m as usize >= count)
    {
        return Err(KernelError::Range {
            what: "mask index",
            value: m as usize,
            min: 0,
            max: count.saturating_sub(1),
        });
    }
    check_index_space("logits", rows * vocab)?;
    if rows == 0 || vocab == 0 {
        return Ok(());
    }
    let max_rows = client.properties().hardware.max_cube_count.1 as usize;
    if rows > max_rows {
        return Err(KernelError::Range {
            what: "masked rows",
            value: rows,
            min: 1,
            max: max_rows,
        });
    }
    // A backend may skip a launch that binds an empty buffer: a row of ones stands in.
    let ones;
    let masks = match masks.is_empty() {
        true => {
            ones = DeviceArray::filled(client, words, u32::MAX);
            &ones
        }
        false => masks,
    };
    let mask_of_row = DeviceArray::upload(client, mask_of_row);
    // SAFETY: lengths and mask indices checked above.
    unsafe {
        mask_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((vocab as u32).div_ceil(UNITS), rows as u32, 1),
            CubeDim::new_1d(UNITS),
            logits.arg(),
            masks.arg(),
            mask_of_row.arg(),
            out.arg(),
            vocab as u32,
            words as u32,
            f32::NEG_INFINITY,
        )
    }
    Ok(())
}
