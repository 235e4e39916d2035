//! Interleaved rotary position embedding with YaRN frequencies, in place on strided rows.
//!
//! Pair `(x[2i], x[2i+1])` of a row at position `p` becomes
//! `((x0 cos - x1 sin) s, (x0 sin + x1 cos) s)` with angle `p * inv_freq[i]` computed in
//! f32 as HF and DeepSeek's code do, and `s` the YaRN cos/sin scale. The frequencies come
//! from `kiln_reference::rope::inv_freq` (computed once on the host). Rows are
//! `rows_per_token` per token, `row_stride` apart, the rope dims starting at `offset`: the
//! 64 rope dims at 128..192 of each q head, or at 512..576 of the compressed KV row.
//! Oracle: `kiln_reference::rope::apply_interleaved`.
use cubecl::prelude::*;

use crate::buffer::check_len;
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel(
    x: &mut Array<f32>,
    positions: &Array<u32>,
    inv_freq: &Array<f32>,
    total_pairs: u32,
    pairs: u32,
    rows_per_token: u32,
    row_stride: u32,
    offset: u32,
    scale: f32,
) {
    let idx = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if idx < total_pairs {
        let row = idx / pairs;
        let i = idx % pairs;
        let pos = positions[(row / rows_per_token) as usize];
        let base = (row * row_stride + offset + 2 * i) as usize;
        let rotated = rotate_pair(x[base], x[base + 1], pos, inv_freq[i as usize], scale);
        x[base] = rotated[0];
        x[base + 1] = rotated[1];
    }
}

/// Pair `(x0, x1)` at position `pos` rotated by the angle `pos * freq` (f32), both values
/// multiplied by `scale`.
#[cube]
pub(crate) fn rotate_pair(
    x0: f32,
    x1: f32,
    pos: u32,
    freq: f32,
    scale: f32,
) -> Vector<f32, Const<2>> {
    let angle = f32::cast_from(pos) * freq;
    let (sin, cos) = (angle.sin(), angle.cos());
    let mut out = Vector::<f32, Const<2>>::empty();
    out[0] = (x0 * cos - x1 * sin) * scale;
    out[1] = (x0 * sin + x1 * cos) * scale;
    out
}

/// The rotation of a batch's rope values where another kernel applies it on the way
/// (`kiln_kernels::mla::write_kv_normed`, `kiln_kernels::mla::absorb_query`): token `t`
/// at `positions[t]`, pair `i` of its 64 rope values turned by `positions[t] * inv_freq[i]`
/// (32 frequencies), cos and sin multiplied by `scale`, as [`rope_inplace`] does.
pub struct Rotation<'a> {
    pub positions: &'a DeviceArray<u32>,
    pub inv_freq: &'a DeviceArray<f32>,
    pub scale: f32,
}

impl Rotation<'_> {
    /// Checks one position per token and 32 frequencies (64 rope values).
    pub(crate) fn check(&self, tokens: usize) -> Result<(), KernelError> {
        check_len("positions", self.positions, tokens)?;
        check_len("inverse frequencies", self.inv_freq, 32)
    }
}

/// Where the rope dims sit in `x`: `tokens * rows_per_token` rows of `row_stride` values,
/// `rope_dim` of them starting at `offset`.
#[derive(Clone, Copy, Debug)]
pub struct RopeLayout {
    pub tokens: usize,
    pub rows_per_token: usize,
    pub row_stride: usize,
    pub offset: usize,
    pub rope_dim: usize,
}

/// Rotates the rope dims of every row of `x` in place.
pub fn rope_inplace<R: Runtime>(
    client: &ComputeClient<R>,
    x: &DeviceArray<f32>,
    layout: RopeLayout,
    positions: &DeviceArray<u32>,
    inv_freq: &DeviceArray<f32>,
    scale: f32,
) -> Result<(), KernelError> {
    let l = layout;
    if !l.rope_dim.is_multiple_of(2) || l.offset + l.rope_dim > l.row_stride {
        return Err(KernelError::Range {
            what: "rope dims (even, inside the row)",
            value: l.offset + l.rope_dim,
            min: 2,
            max: l.row_stride,
        });
    }
    check_len("rows", x, l.tokens * l.rows_per_token * l.row_stride)?;
    check_len("positions", positions, l.tokens)?;
    check_len("inverse frequencies", inv_freq, l.rope_dim / 2)?;
    let total = l.tokens * l.rows_per_token * l.rope_dim / 2;
    if total == 0 {
        return Ok(());
    }
    let cubes = (total as u32).div_ceil(UNITS);
    let x_cubes = cubes.min(client.properties().hardware.max_cube_count.0);
    // SAFETY: every index the kernel forms is inside `x`, `positions` and `inv_freq`.
    unsafe {
        rope_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x_cubes, cubes.div_ceil(x_cubes), 1),
            CubeDim::new_1d(UNITS),
            x.arg(),
            positions.arg(),
            inv_freq.arg(),
            total as u32,
            (l.rope_dim / 2) as u32,
            l.rows_per_token as u32,
            l.row_stride as u32,
            l.offset as u32,
            scale,
        )
    }
    Ok(())
}
