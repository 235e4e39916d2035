//! Appending new tokens' compressed KV rows to the paged cache, in the cache's storage
//! format: [`write_kv`] takes finished rows (`[tokens, 576]` f32: normalised latent + roped
//! k_pe); [`write_kv_normed`] takes the `kv_a` projection's rows as they are and does the
//! latent's RMSNorm and the rope part's rotation on the way (one launch where the rotation,
//! the norm and the write took three; oracles `kiln_reference::norm::rmsnorm` and
//! `kiln_reference::rope::apply_interleaved`).
//! - f32: copied as is;
//! - bf16: round to nearest even, two values per word; bit-exact with
//!   `kiln_reference::formats::bf16_encode`.
//! - fp8 (FlashMLA's layout): per 128-element latent tile the smallest power of two
//!   `scale >= amax / 448` (1 when the tile is zero), read off `amax`'s bits; codes
//!   `e4m3(x / scale)` (a multiplication by a power of two, exact) rounded to nearest even;
//!   the rope part in bf16. Bit-exact with `kiln_reference::mla::fp8_row_encode` on every
//!   backend (no division).
use cubecl::prelude::*;

use super::{KvFormat, PagedKvCache, KV_DIM, V_DIM};
use crate::buffer::{check_index_space, check_len};
use crate::reduce::cube_sum;
use crate::rope::{rotate_pair, Rotation};
use crate::{DeviceArray, KernelError};

/// f32 -> bf16 bits, round to nearest even (inputs are finite).
#[cube]
pub(super) fn bf16_bits(x: f32) -> u32 {
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

/// Units of a write cube: unit `u` holds latent values `4u..4u + 4` and, below 32, rope pair
/// `u` (values `512 + 2u`, `513 + 2u`); a warp's 128 latent values are one fp8 tile.
const UNITS: usize = 128;

/// The slot of a token whose KV row is not kept: a padding row of a batch replayed at a
/// fixed size (the decode step's graphs).
pub const PAD_SLOT: u32 = u32::MAX;

/// Compile-time shape of a cache write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct WriteConfig {
    format: KvFormat,
    /// Normalise the latent and rotate the rope part first ([`write_kv_normed`]).
    normed: bool,
}

/// One cube per token: row `t` of `kv` into cache row `slots[t]` (none for [`PAD_SLOT`]),
/// normalised and rotated first when `cfg.normed` (else `norm`, `positions` and `inv_freq`
/// are not read).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn write_rows_kernel(
    kv: &Array<f32>,
    slots: &Array<u32>,
    cache: &mut Array<u32>,
    norm: &Array<f32>,
    positions: &Array<u32>,
    inv_freq: &Array<f32>,
    eps: f32,
    rope_scale: f32,
    #[comptime] cfg: WriteConfig,
) {
    let t = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let row = t * 576;
    if slots[t] == u32::new(PAD_SLOT as i64) {
        // The whole cube (one token) leaves: no unit reaches the barriers below.
        terminate!();
    }
    let slot = slots[t] as usize;
    let mut x = Array::<f32>::new(4usize);
    #[unroll]
    for j in 0..4usize {
        x[j] = kv[row + 4 * unit + j];
    }
    let rope_unit = unit < 32;
    let mut r0 = 0.0f32;
    let mut r1 = 0.0f32;
    if rope_unit {
        r0 = kv[row + 512 + 2 * unit];
        r1 = kv[row + 513 + 2 * unit];
    }
    let mut partials = SharedMemory::<f32>::new(UNITS);
    if comptime!(cfg.normed) {
        let mut sum = 0.0f32;
        #[unroll]
        for j in 0..4usize {
            sum += x[j] * x[j];
        }
        let total = cube_sum(sum, &mut partials, unit, comptime!(UNITS as u32));
        let inv = 1.0 / (total / f32::cast_from(V_DIM as u32) + eps).sqrt();
        #[unroll]
        for j in 0..4usize {
            x[j] = x[j] * inv * norm[4 * unit + j];
        }
        if rope_unit {
            let rotated = rotate_pair(r0, r1, positions[t], inv_freq[unit], rope_scale);
            r0 = rotated[0];
            r1 = rotated[1];
        }
    }
    if comptime!(cfg.format == KvFormat::F32) {
        let base = slot * 576;
        #[unroll]
        for j in 0..4usize {
            cache[base + 4 * unit + j] = u32::reinterpret(x[j]);
        }
        if rope_unit {
            cache[base + 512 + 2 * unit] = u32::reinterpret(r0);
            cache[base + 513 + 2 * unit] = u32::reinterpret(r1);
        }
    } else if comptime!(cfg.format == KvFormat::Bf16) {
        let base = slot * 288;
        cache[base + 2 * unit] = bf16_bits(x[0]) | (bf16_bits(x[1]) << 16);
        cache[base + 2 * unit + 1] = bf16_bits(x[2]) | (bf16_bits(x[3]) << 16);
        if rope_unit {
            cache[base + 256 + unit] = bf16_bits(r0) | (bf16_bits(r1) << 16);
        }
    } else {
        // The tile's amax over its 32 units (a tree in shared memory: no subgroups).
        let base = slot * 164;
        let mut local = 0.0f32;
        #[unroll]
        for j in 0..4usize {
            local = max(local, x[j].abs());
        }
        partials[unit] = local;
        sync_cube();
        for level in 0..5u32 {
            let stride = 16usize >> level as usize;
            if unit % 32 < stride {
                partials[unit] = max(partials[unit], partials[unit + stride]);
            }
            sync_cube();
        }
        let field = scale_field(partials[unit / 32 * 32]);
        // 2^-k: exact, so `x * inverse` rounds like the reference's `x / scale`.
        let inverse = f32::reinterpret((254 - field) << 23);
        let mut word = 0u32;
        #[unroll]
        for j in 0..4usize {
            let v = x[j] * inverse;
            let code = e4m3_magnitude(v.abs()) | ((u32::reinterpret(v) >> 31) << 7);
            word |= code << (8 * j as u32);
        }
        cache[base + unit] = word;
        if unit % 32 == 0 {
            cache[base + 128 + unit / 32] = field << 23;
        }
        if rope_unit {
            cache[base + 132 + unit] = bf16_bits(r0) | (bf16_bits(r1) << 16);
        }
    }
}

/// Checks the rows and the cache, and that one cube per token fits the grid.
fn validate_write<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &DeviceArray<f32>,
    tokens: usize,
    cache: &PagedKvCache,
) -> Result<(), KernelError> {
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
    Ok(())
}

/// Writes row `t` of `kv` (`[tokens, 576]`, finished rows) into cache row `slots[t]`;
/// a [`PAD_SLOT`] token writes nothing.
pub fn write_kv<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &DeviceArray<f32>,
    slots: &DeviceArray<u32>,
    cache: &PagedKvCache,
) -> Result<(), KernelError> {
    let tokens = slots.len();
    validate_write(client, kv, tokens, cache)?;
    // SAFETY: validated; the unread normalisation arguments are bound to the rows.
    unsafe { launch_write(client, kv, slots, cache, kv, slots, kv, 0.0, 0.0, false) };
    Ok(())
}

/// How [`write_kv_normed`] finishes a `kv_a` row: the latent's RMSNorm (`norm`: 512
/// weights, `eps`), as `kiln_kernels::rmsnorm::rmsnorm_prefix` does, and the rope part's
/// rotation.
pub struct KvRowPrep<'a> {
    pub norm: &'a DeviceArray<f32>,
    pub eps: f32,
    pub rope: Rotation<'a>,
}

/// Writes row `t` of `kv_a` (`[tokens, 576]` as the `kv_a` projection leaves them) into
/// cache row `slots[t]` after normalising its latent and rotating its rope part (`prep`);
/// a [`PAD_SLOT`] token writes nothing.
pub fn write_kv_normed<R: Runtime>(
    client: &ComputeClient<R>,
    kv_a: &DeviceArray<f32>,
    prep: &KvRowPrep,
    slots: &DeviceArray<u32>,
    cache: &PagedKvCache,
) -> Result<(), KernelError> {
    let tokens = slots.len();
    validate_write(client, kv_a, tokens, cache)?;
    check_len("KV norm weights", prep.norm, V_DIM)?;
    prep.rope.check(tokens)?;
    // SAFETY: validated above.
    unsafe {
        launch_write(
            client,
            kv_a,
            slots,
            cache,
            prep.norm,
            prep.rope.positions,
            prep.rope.inv_freq,
            prep.eps,
            prep.rope.scale,
            true,
        )
    };
    Ok(())
}

/// # Safety
/// `kv` holds `slots.len()` rows, the slots are rows of `cache`, and when `normed` the
/// normalisation arguments have 512 weights, a position per row and 32 frequencies.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_write<R: Runtime>(
    client: &ComputeClient<R>,
    kv: &DeviceArray<f32>,
    slots: &DeviceArray<u32>,
    cache: &PagedKvCache,
    norm: &DeviceArray<f32>,
    positions: &DeviceArray<u32>,
    inv_freq: &DeviceArray<f32>,
    eps: f32,
    rope_scale: f32,
    normed: bool,
) {
    let tokens = slots.len();
    if tokens == 0 {
        return;
    }
    let cfg = WriteConfig {
        format: cache.format,
        normed,
    };
    write_rows_kernel::launch_unchecked::<R>(
        client,
        CubeCount::Static(tokens as u32, 1, 1),
        CubeDim::new_1d(UNITS as u32),
        kv.arg(),
        slots.arg(),
        cache.data.arg(),
        norm.arg(),
        positions.arg(),
        inv_freq.arg(),
        eps,
        rope_scale,
        cfg,
    )
}
