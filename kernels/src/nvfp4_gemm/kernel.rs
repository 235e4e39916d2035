//! The cube kernel: one unit per output element, decoding NVFP4 in registers.
use cubecl::prelude::*;

use crate::formats::{byte_at, e2m1_to_f32, e4m3_to_f32};

/// `out[row, col] = sum_k a[row, k] * w_e[col, k]`, with `e` the row's expert when `grouped`.
#[cube(launch_unchecked)]
pub fn nvfp4_gemm_kernel<F: Float>(
    a: &Array<F>,
    packed: &Array<u32>,
    scales: &Array<u32>,
    global_scales: &Array<f32>,
    expert_offsets: &Array<u32>,
    out: &mut Array<f32>,
    n: u32,
    k: u32,
    experts: u32,
    #[comptime] grouped: bool,
) {
    let row = CUBE_POS_X;
    let col = CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X;
    if col < n {
        let mut expert = 0u32;
        if grouped {
            expert = find_expert(expert_offsets, row, experts);
        }
        let blocks = (k / 16) as usize;
        let w_row = (expert * n + col) as usize;
        let word_base = w_row * blocks * 2;
        let scale_base = w_row * blocks;
        let a_base = row as usize * k as usize;
        let global = global_scales[expert as usize];
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
        out[row as usize * n as usize + col as usize] = acc;
    }
}

/// The largest `e < experts` with `offsets[e] <= row` (binary search; empty experts skipped).
#[cube]
fn find_expert(offsets: &Array<u32>, row: u32, experts: u32) -> u32 {
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
