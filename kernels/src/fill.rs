//! Random bits on the device, for building full-size synthetic models and caches without
//! generating gigabytes on the host: `word = (hash(seed, i) & and_mask) | or_mask`. The
//! masks shape the bits into valid values (e.g. NVFP4 codes are any nibble; E4M3 scales and
//! bf16 values keep their exponents in a chosen range). The hash is a 32-bit integer mix
//! (PCG's output permutation on `i * golden + seed`); statistical quality is beside the
//! point, every bit pattern allowed by the masks just has to show up. Arrays of records
//! (an fp8 KV row: codes, power-of-two scales, bf16 rope values) give one field of each
//! record its own masks ([`Field`]).
use std::ops::Range;

use cubecl::prelude::*;

use crate::cuda_source::{cuda_source, output, scalar, CudaSource};
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

#[allow(arithmetic_overflow, clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn fill_kernel(
    out: &mut Array<u32>,
    seed: u32,
    and_mask: u32,
    or_mask: u32,
    period: u32,
    field_start: u32,
    field_end: u32,
    field_and: u32,
    field_or: u32,
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if (i as usize) < out.len() {
        let k = i % period;
        let in_field = k >= field_start && k < field_end;
        let and = select(in_field, field_and, and_mask);
        let or = select(in_field, field_or, or_mask);
        out[i as usize] = (mix(i * 2654435769u32 + seed) & and) | or;
    }
}

/// Words `words` of every record of `period` words, with their own masks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    pub period: u32,
    pub words: Range<u32>,
    pub and_mask: u32,
    pub or_mask: u32,
}

impl Field {
    /// The masks of word `i` of the array: the field's inside it, `masks` elsewhere.
    pub fn masks_of(&self, i: u32, masks: (u32, u32)) -> (u32, u32) {
        if self.words.contains(&(i % self.period)) {
            (self.and_mask, self.or_mask)
        } else {
            masks
        }
    }
}

/// [`fill_random_records`]'s kernel as CUDA C++ ([`cuda_source`]), for a launcher outside
/// CubeCL: its parameters are the array `out`, then the scalars `seed`, `and_mask`,
/// `or_mask` and the field's `period`, `words.start`, `words.end`, `and_mask`, `or_mask`;
/// one unit per word, cubes numbered x then y.
pub fn fill_source() -> Result<CudaSource, KernelError> {
    cuda_source("fill_kernel", CubeDim::new_1d(UNITS), |b| {
        let out = output::<u32>(b);
        let [seed, and, or, period, start, end, field_and, field_or] =
            std::array::from_fn(|_| scalar::<u32>(b));
        fill_kernel::expand(
            &mut b.scope,
            out,
            seed,
            and,
            or,
            period,
            start,
            end,
            field_and,
            field_or,
        );
    })
}

/// Overwrites every word of `out` with masked pseudo-random bits.
pub fn fill_random_bits<R: Runtime>(
    client: &ComputeClient<R>,
    out: &DeviceArray<u32>,
    seed: u32,
    and_mask: u32,
    or_mask: u32,
) -> Result<(), KernelError> {
    let none = Field {
        period: 1,
        words: 0..0,
        and_mask,
        or_mask,
    };
    fill_random_records(client, out, seed, (and_mask, or_mask), &none)
}

/// Overwrites every word of `out` with pseudo-random bits under `masks` (and, or), except
/// the words of `field` in each record, which take the field's masks. A word's bits are
/// those [`fill_random_bits`] gives it under the same masks.
pub fn fill_random_records<R: Runtime>(
    client: &ComputeClient<R>,
    out: &DeviceArray<u32>,
    seed: u32,
    masks: (u32, u32),
    field: &Field,
) -> Result<(), KernelError> {
    if field.period == 0 {
        return Err(KernelError::Range {
            what: "record words",
            value: 0,
            min: 1,
            max: u32::MAX as usize,
        });
    }
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
            masks.0,
            masks.1,
            field.period,
            field.words.start,
            field.words.end,
            field.and_mask,
            field.or_mask,
        )
    }
    Ok(())
}
