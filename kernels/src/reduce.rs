//! Reductions across the units of a cube through shared memory (no subgroup operations, so
//! they run on llvmpipe too).
use cubecl::prelude::*;

/// Sum of `value` over the cube's units (tree reduction in shared memory, any numeric type).
/// `units` must be a power of two; every unit gets the total. Ends with a barrier, so
/// `partials` may be reused at once.
#[cube]
pub fn cube_sum<N: Numeric>(
    value: N,
    partials: &mut SharedMemory<N>,
    unit: usize,
    #[comptime] units: u32,
) -> N {
    partials[unit] = value;
    sync_cube();
    let levels = comptime!(units.trailing_zeros());
    for level in 0..levels {
        let stride = (units as usize) >> (level + 1) as usize;
        if unit < stride {
            let other = partials[unit + stride];
            partials[unit] += other;
        }
        sync_cube();
    }
    let total = partials[0];
    sync_cube();
    total
}
