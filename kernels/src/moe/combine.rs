//! `out[t, :] = shared[t, :] + sum_j weight[t, j] * expert_out[slot[t * k + j], :]`: each
//! token's routed expert outputs, weighted, plus the shared expert's output (when given).
use cubecl::prelude::*;

use crate::buffer::check_len;
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn combine_kernel(
    expert_out: &Array<f32>,
    slot: &Array<u32>,
    weights: &Array<f32>,
    shared: &Array<f32>,
    out: &mut Array<f32>,
    cols: u32,
    top_k: u32,
    #[comptime] with_shared: bool,
) {
    let t = CUBE_POS_X as usize;
    let c = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let n = cols as usize;
    if c < n {
        let mut acc = 0.0f32;
        if with_shared {
            acc = shared[t * n + c];
        }
        for j in 0..top_k as usize {
            let a = t * top_k as usize + j;
            acc += weights[a] * expert_out[slot[a] as usize * n + c];
        }
        out[t * n + c] = acc;
    }
}

/// Combines `tokens` tokens' `k` expert outputs (rows of `cols`) into `out`.
#[allow(clippy::too_many_arguments)]
pub fn combine<R: Runtime>(
    client: &ComputeClient<R>,
    expert_out: &DeviceArray<f32>,
    slot: &DeviceArray<u32>,
    weights: &DeviceArray<f32>,
    shared: Option<&DeviceArray<f32>>,
    tokens: usize,
    cols: usize,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    let pairs = slot.len();
    if tokens == 0 || !pairs.is_multiple_of(tokens) {
        return Err(KernelError::Alignment {
            what: "slots per token",
            value: pairs,
            multiple: tokens.max(1),
        });
    }
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if tokens > max {
        return Err(KernelError::Range {
            what: "tokens",
            value: tokens,
            min: 1,
            max,
        });
    }
    check_len("routing weights", weights, pairs)?;
    check_len("expert outputs", expert_out, pairs * cols)?;
    check_len("output", out, tokens * cols)?;
    if let Some(s) = shared {
        check_len("shared expert output", s, tokens * cols)?;
    }
    // SAFETY: shapes validated; slots are trusted to be a permutation (dispatch writes them).
    unsafe {
        combine_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, (cols as u32).div_ceil(UNITS), 1),
            CubeDim::new_1d(UNITS),
            expert_out.arg(),
            slot.arg(),
            weights.arg(),
            shared.unwrap_or(weights).arg(),
            out.arg(),
            cols as u32,
            (pairs / tokens) as u32,
            shared.is_some(),
        )
    }
    Ok(())
}
