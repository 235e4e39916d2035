//! SwiGLU's activation: `out = silu(gate) * up`, elementwise over `[rows, inter]`, where
//! `silu(x) = x / (1 + e^-x)`. Oracle: `kiln_reference::activation::silu_and_mul` (which
//! takes gate and up side by side in one row).
use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::cuda_source::{cuda_source, input, output, CudaSource};
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn silu_mul_kernel(gate: &Array<f32>, up: &Array<f32>, out: &mut Array<f32>) {
    let i = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if i < out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

/// [`silu_mul`]'s kernel as CUDA C++ ([`cuda_source`]), for a launcher outside CubeCL: its
/// parameters are the arrays `gate`, `up` and `out`; one unit per element, a cube's units
/// consecutive, cubes numbered x then y as [`silu_mul`] launches them.
pub fn silu_mul_source() -> Result<CudaSource, KernelError> {
    cuda_source("silu_mul_kernel", CubeDim::new_1d(UNITS), |b| {
        let (gate, up, out) = (input::<f32>(b), input::<f32>(b), output::<f32>(b));
        silu_mul_kernel::expand(&mut b.scope, gate, up, out);
    })
}

/// `out[i] = silu(gate[i]) * up[i]` for equally long `gate`, `up` and `out`.
pub fn silu_mul<R: Runtime>(
    client: &ComputeClient<R>,
    gate: &DeviceArray<f32>,
    up: &DeviceArray<f32>,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    check_len("up", up, gate.len())?;
    check_len("output", out, gate.len())?;
    if gate.is_empty() {
        return Ok(());
    }
    check_index_space("elements", gate.len())?;
    let cubes = (gate.len() as u32).div_ceil(UNITS);
    let x = cubes.min(client.properties().hardware.max_cube_count.0);
    // SAFETY: all three buffers hold `gate.len()` elements.
    unsafe {
        silu_mul_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(x, cubes.div_ceil(x), 1),
            CubeDim::new_1d(UNITS),
            gate.arg(),
            up.arg(),
            out.arg(),
        )
    }
    Ok(())
}
