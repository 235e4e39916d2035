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

/// Whether `(v, at)` beats `(best, best_at)`: a number against nothing (`at` or `best_at`
/// equal to `none`), a larger number, or an equal one at a lower index.
#[cube]
pub fn better(v: f32, at: u32, best: f32, best_at: u32, none: u32) -> bool {
    let number = at != none && !v.is_nan();
    number && (best_at == none || v > best || (v == best && at < best_at))
}

/// The index of the cube's best `(value, at)` by [`better`] (`none` if no unit has one):
/// a tree reduction in shared memory; every unit gets the index. Ends with a barrier.
#[cube]
pub fn cube_best(
    value: f32,
    at: u32,
    values: &mut SharedMemory<f32>,
    indices: &mut SharedMemory<u32>,
    unit: usize,
    none: u32,
    #[comptime] units: u32,
) -> u32 {
    values[unit] = value;
    indices[unit] = at;
    sync_cube();
    let levels = comptime!(units.trailing_zeros());
    for level in 0..levels {
        let stride = (units as usize) >> (level + 1) as usize;
        if unit < stride {
            let v = values[unit + stride];
            let i = indices[unit + stride];
            if better(v, i, values[unit], indices[unit], none) {
                values[unit] = v;
                indices[unit] = i;
            }
        }
        sync_cube();
    }
    let best = indices[0];
    sync_cube();
    best
}
