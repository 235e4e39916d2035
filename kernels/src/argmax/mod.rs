//! The index of each row's largest value (greedy decoding on the device): only token ids
//! leave the device, not rows of logits (163,840 floats a row at Kimi's vocabulary).
//!
//! One cube per row: each unit scans a strided share of the row keeping its best value and
//! index, then the cube reduces the pairs in shared memory. Ties go to the lowest index;
//! NaN never wins; a row with no number (all NaN) gives 0. Oracle:
//! `kiln_reference::argmax::argmax_rows`.
use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::reduce::{better, cube_best};
use crate::{DeviceArray, KernelError};

/// Units per cube (a power of two, for the reduction).
pub(crate) const UNITS: u32 = 256;
/// An index no row has: "nothing seen yet".
const NONE: u32 = u32::MAX;

/// `out[r] = argmax(logits[r * vocab..(r + 1) * vocab])` for `rows` rows.
pub fn argmax_rows<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &DeviceArray<f32>,
    rows: usize,
    vocab: usize,
    out: &DeviceArray<u32>,
) -> Result<(), KernelError> {
    check_rows(client, rows, vocab, NONE as usize - 1)?;
    check_len("logits", logits, rows * vocab)?;
    check_len("argmax output", out, rows)?;
    check_index_space("logits", rows * vocab)?;
    // SAFETY: lengths checked above.
    unsafe {
        argmax_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(UNITS),
            logits.arg(),
            out.arg(),
            vocab as u32,
        )
    }
    Ok(())
}

/// The shape checks of a kernel that runs a cube per row: at least one row and at most a
/// launch's cubes, rows 1 to `most_vocab` wide.
pub(crate) fn check_rows<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    vocab: usize,
    most_vocab: usize,
) -> Result<(), KernelError> {
    let max = client.properties().hardware.max_cube_count;
    for (what, value, most) in [("rows", rows, max.0 as usize), ("vocab", vocab, most_vocab)] {
        if value == 0 || value > most {
            return Err(KernelError::Range {
                what,
                value,
                min: 1,
                max: most,
            });
        }
    }
    Ok(())
}

#[cube(launch_unchecked)]
fn argmax_kernel(logits: &Array<f32>, out: &mut Array<u32>, vocab: u32) {
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let mut values = SharedMemory::<f32>::new(UNITS as usize);
    let mut indices = SharedMemory::<u32>::new(UNITS as usize);
    let found = row_argmax(
        logits,
        row * vocab as usize,
        vocab as usize,
        unit,
        &mut values,
        &mut indices,
    );
    if unit == 0 {
        out[row] = found;
    }
}

/// The argmax of `logits[base..base + vocab]` (0 when it holds no number), for every unit
/// of a cube of [`UNITS`].
#[cube]
pub(crate) fn row_argmax(
    logits: &Array<f32>,
    base: usize,
    vocab: usize,
    unit: usize,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
) -> u32 {
    let none = u32::new(NONE as i64);
    let mut best = 0.0f32;
    let mut best_at = none;
    // Ascending indices: a later equal value never replaces an earlier one.
    for j in range_stepped(unit, vocab, UNITS as usize) {
        let v = logits[base + j];
        if better(v, j as u32, best, best_at, none) {
            best = v;
            best_at = j as u32;
        }
    }
    let found = cube_best(best, best_at, values, indices, unit, none, UNITS);
    select(found == none, 0u32, found)
}
