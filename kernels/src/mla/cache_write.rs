//! Appending new tokens' compressed KV rows (`[tokens, 576]` f32: normalised latent + roped
//! k_pe) to the paged cache, in the cache's storage format.
//! - f32: copied as is;
//! - bf16: round to nearest even, two values per word; bit-exact with
//!   `kiln_reference::formats::bf16_encode`.
//! - fp8 (FlashMLA's layout): per 128-element latent tile the smallest power of two
//!   `scale >= amax / 448` (1 when the tile is zero), read off `amax`'s bits; codes
//!   `e4m3(x / scale)` (a multiplication by a power of two, exact) rounded to nearest even;
//!   the rope part in bf16. Bit-exact with `kiln_reference::mla::fp8_row_encode` on every
//!   backend (no division).
use cubecl::prelude::*;

use super::{KvFormat, PagedKvCache, KV_DIM};
use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError};

/// f32 -> bf16 bits, round to nearest even (inputs are finite).
#[cube]
fn bf16_bits(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
}

/// |v| -> E4M3 magnitude code, round to nearest even, saturating at 448 (code 0x7e).
#[cube]
fn e4m3_magnitude(mag: f32) -> u32 {
    // floor(log2(mag)), clamped into the subnormal binade (exponent -6).
    let exp = max(((u32::reinterpret(mag) >> 23) & 0xff) as i32 - 127, -6);
    // mag / 2^(exp - 3), exact: a multiplication by a power of two.
    let t = mag * f32::reinterpret(((130 - exp) as u32) << 23);
    let f = t.floor();
    let d = t - f;
    let odd = (u32::cast_from(f) & 1) == 1;
    let steps = u32::cast_from(f) + select(d > 0.5 || (d == 0.5 && odd), 1u32, 0u32);
    min(((exp + 6) as u32) * 8 + steps, 0x7e)
}

/// The f32 exponent field of a tile's scale `2^k`: the smallest `k >= -126` with
/// `amax <= 448 * 2^k`, `k = 0` for `amax == 0`. With `amax = 1.f * 2^(e - 127)` that is
/// `k = e - 135` when `1.f <= 1.75` (mantissa at most `0x60_0000`), else `e - 134`.
#[cube]
fn scale_field(amax: f32) -> u32 {
    let bits = u32::reinterpret(amax);
    let up = select((bits & 0x7f_ffff) > 0x60_0000, 1u32, 0u32);
    select(amax == 0.0, 127u32, max((bits >> 23) + up, 9u32) - 8)
}

#[cube(launch_unchecked)]
fn write_f32_kernel(kv: &Array<f32>, slots: &Array<u32>, cache: &mut Array<u32>) {
    let t = CUBE_POS_X as usize;
    let base = slots[t] as usize * 576;
    for d in range_stepped(UNIT_POS_X as usize, 576, 128) {
        cache[base + d] = u32::reinterpret(kv[t * 576 + d]);
    }
}

#[cube(launch_unchecked)]
fn write_bf16_kernel(kv: &Array<f32>, slots: &Array<u32>, cache: &mut Array<u32>) {
    let t = CUBE_POS_X as usize;
    let base = slots[t] as usize * 288;
    for w in range_stepped(UNIT_POS_X as usize, 288, 128) {
        let lo = bf16_bits(kv[t * 576 + 2 * w]);
        let hi = bf16_bits(kv[t * 576 + 2 * w + 1]);
        cache[base + w] = lo | (hi << 16);
    }
}

#[cube(launch_unchecked)]
fn write_fp8_kernel(kv: &Array<f32>, slots: &Array<u32>, cache: &mut Array<u32>) {
    let t = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize; // 128 units: word `unit` holds latent 4*unit..4*unit+4
    let row = t * 576;
    let base = slots[t] as usize * 164;
    let mut amax = SharedMemory::<f32>::new(128usize);
    let mut local = 0.0f32;
    #[unroll]
    for j in 0..4usize {
        local = max(local, kv[row + 4 * unit + j].abs());
    }
    amax[unit] = local;
    sync_cube();
    // Tile = 32 consecutive units; reduce within each tile.
    for level in 0..5u32 {
        let stride = 16usize >> level as usize;
        if unit % 32 < stride {
            amax[unit] = max(amax[unit], amax[unit + stride]);
        }
        sync_cube();
    }
    let field = scale_field(amax[unit / 32 * 32]);
    // 2^-k: exact, so `x * inverse` rounds like the reference's `x / scale`.
    let inverse = f32::reinterpret((254 - field) << 23);
    let mut word = 0u32;
    #[unroll]
    for j in 0..4usize {
        let v = kv[row + 4 * unit + j] * inverse;
        let code = e4m3_magnitude(v.abs()) | ((u32::reinterpret(v) >> 31) << 7);
        word |= code << (8 * j as u32);
    }
    cache[base + unit] = word;
    if unit % 32 == 0 {
        cache[base + 128 + unit / 32] = field << 23;
    }
    if unit < 32 {
        let lo = bf16_bits(kv[row + 512 + 2 * unit]);
        let hi = bf16_bits(kv[row + 512 + 2 * unit + 1]);
        cache[base + 132 + unit] = lo | (hi << 16);
    }
}

/// Writes row `t` of `kv` (`[tokens, 576]`) into cache row `slots[t]`.
pub fn write_kv<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &DeviceArray<f32>,
    slots: &DeviceArray<u32>,
    cache: &PagedKvCache,
) -> Result<(), KernelError> {
    let tokens = slots.len();
    check_len("KV rows", kv, tokens * KV_DIM)?;
    // The fp8 layout is addressed by byte.
    check_index_space("KV cache bytes", cache.data.len() * 4)?;
    let rows = cache.num_pages * cache.page_size;
    check_len(
        "KV cache (u32 words)",
        &cache.data,
        rows * cache.format.words_per_row(),
    )?;
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if tokens > max {
        return Err(KernelError::Range {
            what: "tokens",
            value: tokens,
            min: 0,
            max,
        });
    }
    if tokens == 0 {
        return Ok(());
    }
    let count = CubeCount::Static(tokens as u32, 1, 1);
    // SAFETY: shapes validated; slots are trusted to be cache rows (the scheduler owns them).
    unsafe {
        match cache.format {
            KvFormat::F32 => write_f32_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(128),
                kv.arg(),
                slots.arg(),
                cache.data.arg(),
            ),
            KvFormat::Bf16 => write_bf16_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(128),
                kv.arg(),
                slots.arg(),
                cache.data.arg(),
            ),
            KvFormat::Fp8 => write_fp8_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_1d(128),
                kv.arg(),
                slots.arg(),
                cache.data.arg(),
            ),
        }
    }
    Ok(())
}
