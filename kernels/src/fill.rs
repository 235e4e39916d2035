//! Random bits on the device, for building full-size synthetic models and caches without
//! generating gigabytes on the host: `word = (hash(seed, i) & and_mask) | or_mask`. The
//! masks shape the bits into valid values (e.g. NVFP4 codes are any nibble; E4M3 scales and
//! bf16 values keep their exponents in a chosen range). The hash is a 32-bit integer mix
//! (PCG's output permutation on `i * golden + seed`); statistical quality is beside the
//! point, every bit pattern allowed by the masks just has to show up.
use cubecl::prelude::*;

use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

// u32 arithmetic wraps on the device, as the hash intends.
#[allow(arithmetic_overflow)]
#[cube]
fn mix(x: u32) -> u32 {
    let state = x * 747796405u32 + 2891336453u32;
    let word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737u32;
    (word >> 22) ^ word
}

#[allow(arithmetic_overflow)]
#[cube(launch_unchecked)]
fn fill_kernel(out: &mut Array<u32>, seed: u32, and_mask: u32, or_mask: u32) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if (i as usize) < out.len() {
        out[i as usize] = (mix(i * 2654435769u32 + seed) & and_mask) | or_mask;
    }
}

/// Overwrites every word of `out` with masked pseudo-random bits.
pub fn fill_random_bits<R: Runtime>(
    client: &ComputeClient<R>,
    out: &DeviceArray<u32>,
    seed: u32,
    and_mask: u32,
    or_mask: u32,
) -> Result<(), KernelError> {
    if out.len() > u32::MAX as usize {
        return Err(KernelError::Range {
            what: "words",
            value: out.len(),
            min: 0,
            max: u32::MAX as usize,
        });
    }
    if out.is_empty() {
        return Ok(());
    }
    let cubes = (out.len() as u32).div_ceil(UNITS);
    let x = cubes.min(client.properties().hardware.max_cube_count.0);
    // SAFETY: every index is bounds-checked against `out.len()` in the kernel.
    unsafe {
        fill_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x, cubes.div_ceil(x), 1),
            CubeDim::new_1d(UNITS),
            out.arg(),
            seed,
            and_mask,
            or_mask,
        )
    }
    Ok(())
}
