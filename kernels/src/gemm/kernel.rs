//! The cube kernel: one unit per output element; the weight format is a compile-time
//! parameter, so bf16 projections and NVFP4 experts share one kernel and one tiling.
use cubecl::prelude::*;

use super::WeightFormat;
use crate::formats::{bf16_to_f32, byte_at, e2m1_to_f32, e4m3_to_f32, half_at};

/// `out[row, col] = sum_k a[row, k] * w_e[col, k]`, with `e` the row's expert when `grouped`.
/// For bf16 weights `scales` and `global_scales` are bound but never read.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gemm_kernel<F: Float>(
    a: &Array<F>,
    weights: &Array<u32>,
    scales: &Array<u32>,
    global_scales: &Array<u32>,
    expert_offsets: &Array<u32>,
    out: &mut Array<f32>,
    n: u32,
    k: u32,
    experts: u32,
    #[comptime] grouped: bool,
    #[comptime] format: WeightFormat,
) {
    let row = CUBE_POS_X;
    let col = CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X;
    if col < n {
        let mut expert = 0u32;
        if grouped {
            expert = find_expert(expert_offsets, row, experts);
        }
        let w_row = (expert * n + col) as usize;
        let a_base = row as usize * k as usize;
        let acc = if comptime!(format == WeightFormat::Nvfp4) {
            let global = f32::reinterpret(global_scales[expert as usize]);
            nvfp4_dot(a, a_base, weights, scales, global, w_row, k as usize)
        } else {
            bf16_dot(a, a_base, weights, w_row, k as usize)
        };
        out[row as usize * n as usize + col as usize] = acc;
    }
}

/// `sum_k a[a_base + k] * w[w_row, k]`, `w` in NVFP4 (`w = e2m1 * scale * global`).
#[cube]
fn nvfp4_dot<F: Float>(
    a: &Array<F>,
    a_base: usize,
    packed: &Array<u32>,
    scales: &Array<u32>,
    global: f32,
    w_row: usize,
    k: usize,
) -> f32 {
    let blocks = k / 16;
    let word_base = w_row * blocks * 2;
    let scale_base = w_row * blocks;
    let mut acc = 0.0f32;
    for blk in 0..blocks {
        let scale = e4m3_to_f32(byte_at(scales, scale_base + blk));
        #[unroll]
        for half in 0..2usize {
            let word = packed[word_base + blk * 2 + half];
            let a_off = a_base + blk * 16 + half * 8;
            #[unroll]
            for j in 0..8usize {
                let w = e2m1_to_f32(word >> (4 * j as u32)) * scale * global;
                acc += f32::cast_from(a[a_off + j]) * w;
            }
        }
    }
    acc
}

/// `sum_k a[a_base + k] * w[w_row, k]`, `w` in bf16, two per word.
#[cube]
fn bf16_dot<F: Float>(
    a: &Array<F>,
    a_base: usize,
    words: &Array<u32>,
    w_row: usize,
    k: usize,
) -> f32 {
    let w_base = w_row * k;
    let mut acc = 0.0f32;
    for kk in 0..k {
        acc += f32::cast_from(a[a_base + kk]) * bf16_to_f32(half_at(words, w_base + kk));
    }
    acc
}

/// The largest `e < experts` with `offsets[e] <= row` (binary search; empty experts skipped).
#[cube]
pub(super) fn find_expert(offsets: &Array<u32>, row: u32, experts: u32) -> u32 {
    let mut lo = 0u32;
    let mut hi = experts;
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if offsets[mid as usize] <= row {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// [`find_expert`] by a whole plane (32 lanes, all active): each round every lane reads one
/// of 32 evenly spaced offsets of the range left and a plane sum counts those `<= row`
/// (a prefix, the offsets being sorted), so 384 experts take 2 dependent loads, not 9.
#[cube]
pub(super) fn find_expert_in_plane(offsets: &Array<u32>, row: u32, experts: u32) -> u32 {
    let mut lo = 0u32;
    let mut width = experts;
    while width > 1 {
        let stride = width.div_ceil(32);
        let probe = UNIT_POS_PLANE * stride;
        let mut at_or_below = 0u32;
        // Nested: a kernel's `&&` evaluates both sides, and the read must stay in bounds.
        #[allow(clippy::collapsible_if)]
        if probe < width {
            if offsets[(lo + probe) as usize] <= row {
                at_or_below = 1;
            }
        }
        // At least lane 0's probe (`offsets[lo] <= row`) counts.
        let next = lo + (plane_sum(at_or_below) - 1) * stride;
        width = min(stride, lo + width - next);
        lo = next;
    }
    lo
}

/// Grouped: finds M-slot `tile`'s expert and rows (`slot` = expert, first row, end row;
/// an empty range when `tile` is past the last expert's tiles) when each expert's rows are
/// cut into tiles of `rows`. Expert `e` has `ceil(count_e / rows)` tiles; unit `u` of the
/// cube's `units` sums the counts of experts `u * per .. (u + 1) * per`, a prefix sum over
/// the units (plane sums, then the warps' totals) gives where its experts' tiles start, and
/// the unit whose range holds `tile` writes the answer. Read `slot` after a `sync_cube`.
#[cube]
pub(super) fn find_tile(
    offsets: &Array<u32>,
    experts: usize,
    tile: usize,
    slot: &mut SharedMemory<u32>,
    unit: usize,
    #[comptime] rows: u32,
    #[comptime] units: u32,
) {
    let mut warp_totals = SharedMemory::<u32>::new(comptime!(units as usize / 32));
    let per = experts.div_ceil(units as usize);
    let first = min(unit * per, experts);
    let last = min(first + per, experts);
    let mut mine = 0u32;
    for e in first..last {
        mine += (offsets[e + 1] - offsets[e]).div_ceil(rows);
    }
    let before_in_warp = plane_exclusive_sum(mine);
    if unit % 32 == 31 {
        warp_totals[unit / 32] = before_in_warp + mine;
    }
    if unit == 0 {
        slot[0] = 0;
        slot[1] = 0;
        slot[2] = 0;
    }
    sync_cube();
    let mut start = before_in_warp;
    for w in 0..unit / 32 {
        start += warp_totals[w];
    }
    let t = tile as u32;
    if t >= start && t < start + mine {
        let mut rest = t - start;
        for e in first..last {
            let begin = offsets[e];
            let end = offsets[e + 1];
            let tiles = (end - begin).div_ceil(rows);
            if rest < tiles {
                slot[0] = e as u32;
                slot[1] = begin + rest * rows;
                slot[2] = min(end, begin + rest * rows + rows);
            }
            rest = select(rest < tiles, 1u32 << 30, rest - tiles);
        }
    }
}
