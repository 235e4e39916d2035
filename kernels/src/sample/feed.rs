//! The step after a step that sampled on the device takes some of its input ids from that
//! step's tokens without a round trip through the host: `tokens[at] = sampled[row]` for each
//! `(at, row)` pair. What lets the scheduler plan and issue step N+1 while step N runs.
use cubecl::prelude::*;

use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;

#[cube(launch_unchecked)]
fn feed_kernel(sampled: &Array<u32>, pairs: &Array<u32>, tokens: &mut Array<u32>, n: u32) {
    let k = ABSOLUTE_POS_X as usize;
    if k < n as usize {
        let at = pairs[2 * k] as usize;
        let row = pairs[2 * k + 1] as usize;
        tokens[at] = sampled[row];
    }
}

/// Writes `sampled[row]` into `tokens[at]` for each `(at, row)` of `feeds`, in stream order
/// after the kernels that wrote `sampled`.
pub fn feed_tokens<R: Runtime>(
    client: &ComputeClient<R>,
    sampled: &DeviceArray<u32>,
    feeds: &[(usize, usize)],
    tokens: &DeviceArray<u32>,
) -> Result<(), KernelError> {
    let range = |what, value: usize, len: usize| {
        (value >= len).then_some(KernelError::Range {
            what,
            value,
            min: 0,
            max: len.saturating_sub(1),
        })
    };
    for &(at, row) in feeds {
        if let Some(e) = range("fed token index", at, tokens.len())
            .or_else(|| range("sampled row", row, sampled.len()))
        {
            return Err(e);
        }
    }
    if feeds.is_empty() {
        return Ok(());
    }
    let pairs: Vec<u32> = feeds
        .iter()
        .flat_map(|&(at, row)| [at as u32, row as u32])
        .collect();
    let pairs = DeviceArray::upload(client, &pairs);
    // SAFETY: every index checked above against its buffer.
    unsafe {
        feed_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((feeds.len() as u32).div_ceil(UNITS), 1, 1),
            CubeDim::new_1d(UNITS),
            sampled.arg(),
            pairs.arg(),
            tokens.arg(),
            feeds.len() as u32,
        )
    }
    Ok(())
}
