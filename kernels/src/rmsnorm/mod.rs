//! RMSNorm over rows, optionally fused with the residual add that precedes it:
//! `y = x / sqrt(mean(x^2) + eps) * weight`; the fused form first does `residual += delta`
//! and normalises the updated residual, saving one pass over the hidden state per norm.
//! [`rmsnorm_prefix`] normalises only the first `weight.len()` columns of wider rows and
//! copies the rest (MLA's compressed KV row: the 512 latent values are normalised, the 64
//! rope values are not).
//! Oracle: `kiln_reference::norm::rmsnorm`. One cube per row, a shared-memory reduction of
//! the sum of squares (no subgroup operations, so it runs on llvmpipe too). Rows of whole
//! 4-float vectors move as vectors, and a cube has as many units as the row has vectors (up
//! to the device's limit, at most 1024): a decode step normalises one row per token, so the
//! kernel's time is the number of dependent memory round trips each unit makes (with 128
//! scalar units, a 7168-wide row took 46 us on the H200; `benches/RESULTS.md`).
use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::reduce::cube_sum;
use crate::{DeviceArray, KernelError};

/// The most units a cube takes.
const MAX_UNITS: usize = 1024;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rmsnorm_kernel<N: Size>(
    residual: &mut Array<Vector<f32, N>>,
    delta: &Array<Vector<f32, N>>,
    weight: &Array<Vector<f32, N>>,
    out: &mut Array<Vector<f32, N>>,
    cols: u32,
    stride: u32,
    eps: f32,
    #[comptime] units: u32,
    #[comptime] fused_add: bool,
) {
    let width = N::value();
    let row = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    // In vectors.
    let n = cols as usize / width;
    let row_len = stride as usize / width;
    let base = row * row_len;
    let mut partials = SharedMemory::<f32>::new(units as usize);
    let mut sum = 0.0f32;
    for c in range_stepped(unit, n, units as usize) {
        let mut v = residual[base + c];
        if fused_add {
            v += delta[base + c];
            residual[base + c] = v;
        }
        #[unroll]
        for e in 0..width {
            sum += v[e] * v[e];
        }
    }
    let total = cube_sum(sum, &mut partials, unit, units);
    let inv = Vector::new(1.0 / (total / f32::cast_from(cols) + eps).sqrt());
    for c in range_stepped(unit, n, units as usize) {
        out[base + c] = residual[base + c] * inv * weight[c];
    }
    for c in range_stepped(n + unit, row_len, units as usize) {
        out[base + c] = residual[base + c];
    }
}

fn validate(
    x: &DeviceArray<f32>,
    rows: usize,
    stride: usize,
    weight: &DeviceArray<f32>,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    let cols = weight.len();
    if rows == 0 || cols == 0 || stride < cols {
        return Err(KernelError::Range {
            what: "rows, and columns within the row stride",
            value: cols,
            min: 1,
            max: stride,
        });
    }
    check_index_space("row elements", rows * stride)?;
    check_len("input rows", x, rows * stride)?;
    check_len("output rows", out, rows * stride)
}

/// One cube per row: the grid's first dimension bounds the rows.
fn check_rows<R: Runtime>(client: &ComputeClient<R>, rows: usize) -> Result<(), KernelError> {
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if rows > max {
        return Err(KernelError::Range {
            what: "rows",
            value: rows,
            min: 1,
            max,
        });
    }
    Ok(())
}

/// `out = rmsnorm(x) * weight` for `rows` rows of `weight.len()` columns.
pub fn rmsnorm<R: Runtime>(
    client: &ComputeClient<R>,
    x: &DeviceArray<f32>,
    rows: usize,
    weight: &DeviceArray<f32>,
    eps: f32,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    rmsnorm_prefix(client, x, rows, weight.len(), weight, eps, out)
}

/// RMSNorm of the first `weight.len()` columns of rows `stride` wide; the remaining
/// columns are copied to `out` unchanged.
pub fn rmsnorm_prefix<R: Runtime>(
    client: &ComputeClient<R>,
    x: &DeviceArray<f32>,
    rows: usize,
    stride: usize,
    weight: &DeviceArray<f32>,
    eps: f32,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    validate(x, rows, stride, weight, out)?;
    check_rows(client, rows)?;
    // SAFETY: validated; without the fused add the delta slot is never read (bound to the
    // weights, since one buffer may not be bound writable and read-only at once).
    unsafe { launch(client, x, weight, rows, stride, weight, eps, out, false) };
    Ok(())
}

/// `residual += delta; out = rmsnorm(residual) * weight`.
pub fn add_rmsnorm<R: Runtime>(
    client: &ComputeClient<R>,
    residual: &DeviceArray<f32>,
    delta: &DeviceArray<f32>,
    rows: usize,
    weight: &DeviceArray<f32>,
    eps: f32,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    validate(residual, rows, weight.len(), weight, out)?;
    check_rows(client, rows)?;
    check_len("delta rows", delta, rows * weight.len())?;
    // SAFETY: validated above.
    unsafe {
        launch(
            client,
            residual,
            delta,
            rows,
            weight.len(),
            weight,
            eps,
            out,
            true,
        )
    };
    Ok(())
}

/// # Safety
/// Buffers must hold `rows * stride` elements, `stride >= weight.len()`.
#[allow(clippy::too_many_arguments)]
unsafe fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    residual: &DeviceArray<f32>,
    delta: &DeviceArray<f32>,
    rows: usize,
    stride: usize,
    weight: &DeviceArray<f32>,
    eps: f32,
    out: &DeviceArray<f32>,
    fused_add: bool,
) {
    // Whole vectors when the row and its normalised prefix are multiples of 4 floats.
    let width = if stride.is_multiple_of(4) && weight.len().is_multiple_of(4) {
        4
    } else {
        1
    };
    let vectors = weight.len() / width;
    let hw = client.properties().hardware.max_units_per_cube as usize;
    let units = vectors
        .next_power_of_two()
        .clamp(32, MAX_UNITS.min(1 << hw.max(32).ilog2())) as u32;
    unsafe {
        rmsnorm_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, 1, 1),
            CubeDim::new_1d(units),
            width,
            residual.arg(),
            delta.arg(),
            weight.arg(),
            out.arg(),
            weight.len() as u32,
            stride as u32,
            eps,
            units,
            fused_add,
        )
    }
}
