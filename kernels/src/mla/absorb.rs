//! MLA weight absorption on the device (oracle: `kiln_reference::absorb`):
//! - [`absorb_query`]: `[tokens, heads, nope + rope]` queries -> `[tokens, heads, 576]`
//!   absorbed queries (`q_nope W_UK_h` then `q_pe`, rotated on the way), ready for
//!   [`super::mla_decode`];
//! - [`project_values`]: the attention's `[tokens, heads, 512]` latent output ->
//!   `[tokens, heads, v]` values (`W_UV_h`), the input of `o_proj`.
//!
//! `kv_b_proj.weight` stays in bf16 as loaded (`[heads * (nope + v), 512]`, two values per
//! word). With [`Precision::Bf16`] on a device with bf16 tensor cores (and `nope % 16 == 0`)
//! both run as per-head tensor-core products (`absorb_mma.rs`, activations rounded to bf16);
//! elsewhere one unit computes one output element in f32 (the correct-first form, which at
//! an 8k-token prefill took 139 ms per Kimi layer for the values alone: `benches/RESULTS.md`).
use cubecl::prelude::*;

use super::absorb_mma::{self, head_product_kernel};
use super::{KV_DIM, V_DIM};
use crate::buffer::{check_index_space, check_len};
use crate::formats::{bf16_to_f32, half_at};
use crate::rope::{rotate_pair, Rotation};
use crate::tensor_cores::has_bf16_mma;
use crate::{DeviceArray, KernelError, Precision};

const UNITS: u32 = 64;

/// Head split of `kv_b_proj` (`nope` key rows then `v` value rows per head).
#[derive(Clone, Copy, Debug)]
pub struct KvBShape {
    pub heads: usize,
    pub nope: usize,
    pub v: usize,
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn absorb_query_kernel(
    q: &Array<f32>,
    kv_b: &Array<u32>,
    out: &mut Array<f32>,
    positions: &Array<u32>,
    inv_freq: &Array<f32>,
    nope: u32,
    v: u32,
    heads: u32,
    rope_scale: f32,
) {
    let th = CUBE_POS_X as usize; // token * heads + head
    let c = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let h = th % heads as usize;
    let width = nope as usize + 64;
    if c < 512 {
        let mut acc = 0.0f32;
        for d in 0..nope as usize {
            let w = bf16_to_f32(half_at(kv_b, (h * (nope + v) as usize + d) * 512 + c));
            acc += q[th * width + d] * w;
        }
        out[th * 576 + c] = acc;
    } else if c < 576 {
        let pair = (c - 512) / 2;
        let at = th * width + nope as usize + 2 * pair;
        let pos = positions[th / heads as usize];
        let rotated = rotate_pair(q[at], q[at + 1], pos, inv_freq[pair], rope_scale);
        out[th * 576 + c] = rotated[(c - 512) % 2];
    }
}

#[cube(launch_unchecked)]
fn project_values_kernel(
    latent: &Array<f32>,
    kv_b: &Array<u32>,
    out: &mut Array<f32>,
    nope: u32,
    v: u32,
    heads: u32,
) {
    let th = CUBE_POS_X as usize;
    let j = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let h = th % heads as usize;
    if j < v as usize {
        let w_row = (h * (nope + v) as usize + nope as usize + j) * 512;
        let mut acc = 0.0f32;
        for c in 0..512usize {
            acc += latent[th * 512 + c] * bf16_to_f32(half_at(kv_b, w_row + c));
        }
        out[th * v as usize + j] = acc;
    }
}

fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    rows: usize,
    kv_b: &DeviceArray<u32>,
    s: KvBShape,
) -> Result<(), KernelError> {
    check_len(
        "kv_b_proj (u32 words)",
        kv_b,
        s.heads * (s.nope + s.v) * V_DIM / 2,
    )?;
    // The widest of the rows read or written: queries, absorbed queries, values.
    let width = KV_DIM.max(s.nope + KV_DIM - V_DIM).max(s.v);
    check_index_space("tokens x heads x row width", rows * width)?;
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if rows == 0 || rows > max {
        return Err(KernelError::Range {
            what: "tokens x heads",
            value: rows,
            min: 1,
            max,
        });
    }
    if s.heads > 65_535 {
        return Err(KernelError::Range {
            what: "heads (a grid axis)",
            value: s.heads,
            min: 1,
            max: 65_535,
        });
    }
    Ok(())
}

/// True when [`absorb_query`] and [`project_values`] run on the tensor cores.
pub fn absorbs_on_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    shape: KvBShape,
    precision: Precision,
) -> bool {
    precision == Precision::Bf16 && shape.nope.is_multiple_of(16) && has_bf16_mma(client)
}

/// Launches the tensor-core product: with `rope` the absorption (N = 512, `q_pe` rotated),
/// else the value projection (N = v; the rotation's arguments bound to `kv_b` and `a`, not
/// read). Trusts validated shapes.
fn launch_mma<R: Runtime>(
    client: &ComputeClient<R>,
    a: &DeviceArray<f32>,
    tokens: usize,
    kv_b: &DeviceArray<u32>,
    shape: KvBShape,
    out: &DeviceArray<f32>,
    rope: Option<&Rotation>,
) {
    let absorb = rope.is_some();
    let n = if absorb { V_DIM } else { shape.v };
    let (positions, inv_freq, scale) = match rope {
        Some(r) => (r.positions, r.inv_freq, r.scale),
        None => (kv_b, a, 1.0),
    };
    // SAFETY: validated shapes; `nope % 16 == 0` keeps every vector load aligned and whole.
    unsafe {
        head_product_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(
                (tokens as u32).div_ceil(64),
                n.div_ceil(absorb_mma::BN) as u32,
                shape.heads as u32,
            ),
            CubeDim::new_1d(absorb_mma::UNITS),
            a.arg(),
            kv_b.arg(),
            out.arg(),
            positions.arg(),
            inv_freq.arg(),
            tokens as u32,
            shape.heads as u32,
            shape.nope as u32,
            shape.v as u32,
            scale,
            absorb,
        )
    }
}

/// `q` `[tokens, heads, nope + 64]` (`q_pe` not yet rotated) -> `out` `[tokens, heads,
/// 576]`, `q_pe` rotated by `rope`.
#[allow(clippy::too_many_arguments)]
pub fn absorb_query<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    tokens: usize,
    kv_b: &DeviceArray<u32>,
    shape: KvBShape,
    rope: &Rotation,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    let rows = tokens * shape.heads;
    validate(client, rows, kv_b, shape)?;
    check_len("queries", q, rows * (shape.nope + KV_DIM - V_DIM))?;
    check_len("absorbed queries", out, rows * KV_DIM)?;
    rope.check(tokens)?;
    if absorbs_on_tensor_cores(client, shape, precision) {
        launch_mma(client, q, tokens, kv_b, shape, out, Some(rope));
        return Ok(());
    }
    // SAFETY: shapes validated above.
    unsafe {
        absorb_query_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, (KV_DIM as u32).div_ceil(UNITS), 1),
            CubeDim::new_1d(UNITS),
            q.arg(),
            kv_b.arg(),
            out.arg(),
            rope.positions.arg(),
            rope.inv_freq.arg(),
            shape.nope as u32,
            shape.v as u32,
            shape.heads as u32,
            rope.scale,
        )
    }
    Ok(())
}

/// `latent` `[tokens, heads, 512]` -> `out` `[tokens, heads, v]`.
pub fn project_values<R: Runtime>(
    client: &ComputeClient<R>,
    latent: &DeviceArray<f32>,
    tokens: usize,
    kv_b: &DeviceArray<u32>,
    shape: KvBShape,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    let rows = tokens * shape.heads;
    validate(client, rows, kv_b, shape)?;
    check_len("attention output", latent, rows * V_DIM)?;
    check_len("values", out, rows * shape.v)?;
    if absorbs_on_tensor_cores(client, shape, precision) {
        launch_mma(client, latent, tokens, kv_b, shape, out, None);
        return Ok(());
    }
    // SAFETY: shapes validated above.
    unsafe {
        project_values_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, (shape.v as u32).div_ceil(UNITS), 1),
            CubeDim::new_1d(UNITS),
            latent.arg(),
            kv_b.arg(),
            out.arg(),
            shape.nope as u32,
            shape.v as u32,
            shape.heads as u32,
        )
    }
    Ok(())
}
