//! Embedding lookup: `out[t, :] = table[tokens[t], :]`, the table in bf16 (two values per
//! word), the output in f32. Token ids are checked on the host before they reach the device
//! (an out-of-range id is the caller's error, not a device fault).
use cubecl::prelude::*;

use crate::buffer::check_len;
use crate::formats::{bf16_to_f32, half_at};
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn embedding_kernel(table: &Array<u32>, tokens: &Array<u32>, out: &mut Array<f32>, hidden: u32) {
    let t = CUBE_POS_X as usize;
    let h = hidden as usize;
    let c = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    if c < h {
        out[t * h + c] = bf16_to_f32(half_at(table, tokens[t] as usize * h + c));
    }
}

/// Gathers `tokens.len()` rows of a `[vocab, hidden]` bf16 table into `out`.
pub fn embedding<R: Runtime>(
    client: &ComputeClient<R>,
    table: &DeviceArray<u32>,
    vocab: usize,
    hidden: usize,
    tokens: &DeviceArray<u32>,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    if !hidden.is_multiple_of(2) {
        return Err(KernelError::Alignment {
            what: "hidden (bf16 table)",
            value: hidden,
            multiple: 2,
        });
    }
    check_len("embedding table (u32 words)", table, vocab * hidden / 2)?;
    check_len("output", out, tokens.len() * hidden)?;
    if tokens.is_empty() {
        return Ok(());
    }
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if tokens.len() > max {
        return Err(KernelError::Range {
            what: "tokens",
            value: tokens.len(),
            min: 1,
            max,
        });
    }
    // SAFETY: shapes checked; token ids are trusted to be below `vocab`.
    unsafe {
        embedding_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens.len() as u32, (hidden as u32).div_ceil(UNITS), 1),
            CubeDim::new_1d(UNITS),
            table.arg(),
            tokens.arg(),
            out.arg(),
            hidden as u32,
        )
    }
    Ok(())
}
