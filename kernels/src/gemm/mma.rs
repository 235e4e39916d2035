//! The tensor-core GEMM (CUDA `mma.sync m16n8k16`, bf16 operands, f32 accumulators) for
//! `M > 16`: dense projections at batch > 16, prefill, and the grouped MoE GEMM.
//!
//! A cube computes a [`BM`] x [`BN`] tile of `C` (tokens x weight rows) with 8 warps, each a
//! 32 x 32 sub-tile (2 x 4 MMA tiles). Per step of [`BK`] along K the cube copies its
//! activation rows into shared memory as bf16 and decodes its weight rows there (NVFP4:
//! `e2m1 * block scale`, which has at most 6 significant bits and is exact in bf16; the
//! fragment layout's decode yields it times `2^-14`, two values per bf16x2 multiply; the f32
//! global scale, with `2^14` there, multiplies the accumulator once at the end), then each
//! warp runs 4 k-steps of 8 MMAs from `ldmatrix` fragments. The grid's fastest axis walks M, so the cubes that
//! share a weight tile run together and all but the first read it from L2.
//!
//! Grouped (MoE): rows of `A` are sorted by expert, `expert_offsets` on the device. The grid
//! has `ceil(M / BM) + experts` M-slots (each expert adds at most one partial tile); a cube
//! finds its (expert, tile) with a prefix sum of the experts' tile counts over its 256
//! units, so no expert's tile mixes rows of two experts and no host sync is needed.
//!
//! NVFP4 weights in the fragment layout (`fragments.rs`) are decoded into shared memory as
//! the B fragments themselves, `[tile of 16 rows][step][lane]`, one 16-byte read per lane,
//! tile and step; the activations go into shared memory in the same permuted column order
//! within each 16 columns (fragment column `2c + b` holds column `4c + b`, `2c + 8 + b` holds
//! `4c + 2 + b`), so `ldmatrix` hands every lane the columns its weights have.
//!
//! Rounding: activations are rounded to bf16 (weights are exact in bf16); the conformance
//! tolerance adds one bf16 rounding per product (`Tolerance::with_operands`).
use cubecl::prelude::*;
use half::bf16;

use super::fragments::{decode_step, TWO_POW_14};
use super::kernel::find_tile;
use super::WeightFormat;
use crate::formats::{e2m1_to_f32, e4m3_to_f32};
use crate::warp_mma::{load_a_tile, mma_step, Acc, Bf16x8, Frag};

/// Tile rows (tokens).
pub const BM: u32 = 64;
/// Tile columns (weight rows).
pub const BN: u32 = 128;
/// K per shared-memory step.
pub const BK: u32 = 64;
/// 8 warps.
pub const UNITS: u32 = 256;
/// Shared-memory row stride in 16-byte vectors: 8 per row of BK bf16, plus one so the 8
/// rows an `ldmatrix` reads fall in distinct bank groups.
const STRIDE: usize = 9;

/// Grid: (M-slots, ceil(n / BN)); [`UNITS`] units. Trusts `k % BK == 0`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn mma_gemm_kernel<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Vector<u32, Const<4>>>,
    scales: &Array<u32>,
    global_scales: &Array<u32>,
    expert_offsets: &Array<u32>,
    out: &mut Array<f32>,
    m: u32,
    n: u32,
    k: u32,
    experts: u32,
    #[comptime] grouped: bool,
    #[comptime] format: WeightFormat,
    #[comptime] fragments: bool,
) {
    let unit = UNIT_POS_X as usize;
    let warp = unit / 32;
    let lane = unit % 32;
    let g = lane / 4;
    let t = lane % 4;
    let n = n as usize;
    let k = k as usize;
    let n0 = CUBE_POS_Y as usize * 128;

    // This cube's expert and rows.
    let mut slot = SharedMemory::<u32>::new(3usize);
    if grouped {
        find_tile(
            expert_offsets,
            experts as usize,
            CUBE_POS_X as usize,
            &mut slot,
            unit,
            BM,
            UNITS,
        );
    } else if unit == 0 {
        slot[0] = 0;
        slot[1] = CUBE_POS_X * 64;
        slot[2] = min(m, CUBE_POS_X * 64 + 64);
    }
    sync_cube();
    let expert = slot[0] as usize;
    let row_begin = slot[1] as usize;
    let row_end = slot[2] as usize;

    if row_begin < row_end {
        let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
        let mut a_s = SharedMemory::<Bf16x8>::new_aligned(64 * STRIDE, 16usize);
        let mut w_s = SharedMemory::<Bf16x8>::new_aligned(128 * STRIDE, 16usize);
        let wm = warp / 4;
        let wn = warp % 4;
        let mut acc = Array::<Acc>::new(16usize);
        #[unroll]
        for i in 0..16usize {
            acc[i] = Acc::new(0.0);
        }
        // The rows this unit copies. Activations: rows `unit / 8` and `32 + unit / 8`, 8
        // values at `(unit % 8) * 8` of each, so a warp's loads cover whole rows. Weights:
        // NVFP4 row `unit / 2` (32 values at `(unit % 2) * 32`); bf16 rows `j * 32 + unit / 8`
        // (8 values at `(unit % 8) * 8`), one 16-byte vector each.
        let a_row = min(row_begin + unit / 8, row_end - 1);
        let a_row2 = min(row_begin + 32 + unit / 8, row_end - 1);
        let w_local = unit / 2;
        let w_first = expert * n + n0;
        let w_last = expert * n + n - 1;

        // This cube's K steps (a split of them when the grid's z axis splits K). The next
        // step's raw operands are loaded into registers before this step's MMAs run, so
        // their latency hides behind the tensor-core work.
        let steps = k / 64;
        let kt_begin = steps * CUBE_POS_Z as usize / CUBE_COUNT_Z as usize;
        let kt_end = steps * (CUBE_POS_Z as usize + 1) / CUBE_COUNT_Z as usize;
        let part = unit % 2;
        let mut a_raw = Array::<Vector<F, Const<4>>>::new(4usize);
        let mut w_raw = Array::<Vector<u32, Const<4>>>::new(4usize);
        let mut s_raw = Array::<u32>::new(2usize);
        let w_tile = (expert * n + min(n0 + (unit / 32) * 16, n - 1)) / 16;
        load_raw(
            a, weights, scales, &mut a_raw, &mut w_raw, &mut s_raw, a_row, a_row2, w_first, w_last,
            w_tile, k, kt_begin, unit, format, fragments,
        );
        for kt in kt_begin..kt_end {
            // Activations: 8 columns of each of two rows -> one vector of 8 bf16 per row.
            #[unroll]
            for h in 0..2usize {
                let mut v = Bf16x8::empty();
                if comptime!(fragments) {
                    // Fragment columns 2c + b (vector 0) and 2c + 8 + b (vector 1) of a
                    // 16-column group hold columns 4c + b and 4c + 2 + b. This unit has
                    // columns 8 * half + 0..8 of its group as pairs p0..p3; vector `half` of
                    // the group takes two pairs from this unit and two from its neighbour
                    // (lane ^ 1, the other half), traded by shuffles.
                    let half = unit % 2;
                    let mut p = Array::<u32>::new(4usize);
                    #[unroll]
                    for j in 0..4usize {
                        let mut pair = Frag::empty();
                        pair[0] = bf16::cast_from(a_raw[2 * h + j / 2][2 * (j % 2)]);
                        pair[1] = bf16::cast_from(a_raw[2 * h + j / 2][2 * (j % 2) + 1]);
                        p[j] = u32::reinterpret(pair);
                    }
                    // Half 0 keeps p0, p2 and sends p1, p3; half 1 keeps p1, p3, sends p0, p2.
                    let got_a = plane_shuffle_xor(select(half == 0, p[1], p[0]), 1);
                    let got_b = plane_shuffle_xor(select(half == 0, p[3], p[2]), 1);
                    let mut words = Vector::<u32, Const<4>>::empty();
                    words[0] = select(half == 0, p[0], got_a);
                    words[1] = select(half == 0, p[2], got_b);
                    words[2] = select(half == 0, got_a, p[1]);
                    words[3] = select(half == 0, got_b, p[3]);
                    v = Bf16x8::reinterpret(words);
                } else {
                    #[unroll]
                    for e in 0..8usize {
                        v[e] = bf16::cast_from(a_raw[2 * h + e / 4][e % 4]);
                    }
                }
                a_s[(h * 32 + unit / 8) * STRIDE + unit % 8] = v;
            }
            // Weights: 32 values -> 4 vectors of 8 bf16.
            if comptime!(fragments) {
                // One fragment word per step: registers R0..R3 (rows g, g + 8, g, g + 8),
                // decoded as in the GEMV (`fragments::decode_step`): `e2m1 * scale * 2^-14`
                // exactly; `2^14` goes with the global scale at the end.
                #[unroll]
                for s in 0..4usize {
                    let frags = decode_step(w_raw[0][s], s_raw[s / 2], s);
                    let mut v = Bf16x8::empty();
                    #[unroll]
                    for i in 0..4usize {
                        v[2 * i] = frags[i][0];
                        v[2 * i + 1] = frags[i][1];
                    }
                    w_s[((unit / 32) * 4 + s) * 32 + lane] = v;
                }
            } else if comptime!(format == WeightFormat::Nvfp4) {
                let s_shift = (((kt * 4 + part * 2) % 4) * 8) as u32;
                let s0 = e4m3_to_f32((s_raw[0] >> s_shift) & 0xff);
                let s1 = e4m3_to_f32((s_raw[0] >> (s_shift + 8)) & 0xff);
                let word4 = w_raw[0];
                #[unroll]
                for j in 0..4usize {
                    let word = word4[j];
                    let scale = select(j < 2, s0, s1);
                    let mut v = Bf16x8::empty();
                    #[unroll]
                    for i in 0..8usize {
                        v[i] = bf16::cast_from(e2m1_to_f32(word >> (4 * i as u32)) * scale);
                    }
                    w_s[w_local * STRIDE + part * 4 + j] = v;
                }
            } else {
                #[unroll]
                for j in 0..4usize {
                    w_s[(j * 32 + unit / 8) * STRIDE + unit % 8] = Bf16x8::reinterpret(w_raw[j]);
                }
            }
            sync_cube();
            load_raw(
                a,
                weights,
                scales,
                &mut a_raw,
                &mut w_raw,
                &mut s_raw,
                a_row,
                a_row2,
                w_first,
                w_last,
                w_tile,
                k,
                min(kt + 1, kt_end - 1),
                unit,
                format,
                fragments,
            );

            #[unroll]
            for ks in 0..4usize {
                let mut af = Array::<Frag>::new(8usize);
                #[unroll]
                for mt in 0..2usize {
                    let row0 = wm * 32 + mt * 16;
                    load_a_tile(&a_s, row0, ks * 2, STRIDE, lane, &mut af, comptime!(mt * 4));
                }
                #[unroll]
                for np in 0..2usize {
                    let mut bf = Array::<Frag>::new(4usize);
                    if comptime!(fragments) {
                        // (R0, R2) serve rows g, (R1, R3) rows g + 8.
                        let v = w_s[((wn * 2 + np) * 4 + ks) * 32 + lane];
                        #[unroll]
                        for f in 0..4usize {
                            let r = comptime!((f % 2) * 2 + f / 2);
                            let mut frag = Frag::empty();
                            frag[0] = v[2 * r];
                            frag[1] = v[2 * r + 1];
                            bf[f] = frag;
                        }
                    } else {
                        let r = wn * 32 + np * 16 + (lane / 16) * 8 + lane % 8;
                        let at = r * STRIDE + ks * 2 + (lane / 8) % 2;
                        let m = mma.load_matrix::<Bf16x8, Const<2>>(
                            &w_s.slice(at, at + 1),
                            cmma::MatrixIdent::B,
                            4usize,
                            false,
                        );
                        #[unroll]
                        for f in 0..4usize {
                            bf[f] = m[f];
                        }
                    }
                    #[unroll]
                    for half in 0..2usize {
                        #[unroll]
                        for mt in 0..2usize {
                            let c = comptime!((mt * 4 + np * 2 + half) * 2);
                            mma_step(
                                &af,
                                comptime!(mt * 4),
                                &bf,
                                comptime!(half * 2),
                                &mut acc,
                                c,
                            );
                        }
                    }
                }
            }
            sync_cube();
        }

        let mut global = 1.0f32;
        if comptime!(format == WeightFormat::Nvfp4) {
            global = f32::reinterpret(global_scales[expert]);
        }
        if comptime!(fragments) {
            global *= TWO_POW_14;
        }
        #[unroll]
        for mt in 0..2usize {
            #[unroll]
            for nt in 0..4usize {
                #[unroll]
                for half in 0..2usize {
                    let row = row_begin + wm * 32 + mt * 16 + g + half * 8;
                    let col = n0 + wn * 32 + nt * 8 + 2 * t;
                    let v = acc[(mt * 4 + nt) * 2 + half];
                    // With K split, each split writes its own slice of `out` (summed later).
                    let base = CUBE_POS_Z as usize * m as usize * n + row * n + col;
                    if row < row_end {
                        if col < n {
                            out[base] = v[0] * global;
                        }
                        if col + 1 < n {
                            out[base + 1] = v[1] * global;
                        }
                    }
                }
            }
        }
    }
}

/// This unit's raw operands of K step `kt` (rows as the kernel assigns them): 16 activations
/// (2 vectors of `a_row`, 2 of `a_row2`), and 32 weights
/// (NVFP4: one vector of codes and the word holding their 2 block scales; bf16: 4 vectors of
/// 4 rows, clamped to `w_last`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_raw<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Vector<u32, Const<4>>>,
    scales: &Array<u32>,
    a_raw: &mut Array<Vector<F, Const<4>>>,
    w_raw: &mut Array<Vector<u32, Const<4>>>,
    s_raw: &mut Array<u32>,
    a_row: usize,
    a_row2: usize,
    w_first: usize,
    w_last: usize,
    w_tile: usize,
    k: usize,
    kt: usize,
    unit: usize,
    #[comptime] format: WeightFormat,
    #[comptime] fragments: bool,
) {
    let col = kt * 64 + (unit % 8) * 8;
    let (at, at2) = ((a_row * k + col) / 4, (a_row2 * k + col) / 4);
    a_raw[0] = a[at];
    a_raw[1] = a[at + 1];
    a_raw[2] = a[at2];
    a_raw[3] = a[at2 + 1];
    let part = unit % 2;
    if comptime!(fragments) {
        // Tile `unit / 32` of the cube's 8, lane `unit % 32`; its 8 scale bytes.
        let tile = w_tile * (k / 64) + kt;
        let lane = unit % 32;
        w_raw[0] = weights[tile * 32 + lane];
        s_raw[0] = scales[tile * 16 + (lane / 4) * 2];
        s_raw[1] = scales[tile * 16 + (lane / 4) * 2 + 1];
    } else if comptime!(format == WeightFormat::Nvfp4) {
        let w_row = min(w_first + unit / 2, w_last);
        w_raw[0] = weights[w_row * (k / 32) + kt * 2 + part];
        s_raw[0] = scales[(w_row * (k / 16) + kt * 4 + part * 2) / 4];
    } else {
        #[unroll]
        for j in 0..4usize {
            let w_row = min(w_first + j * 32 + unit / 8, w_last);
            w_raw[j] = weights[w_row * (k / 8) + kt * 8 + unit % 8];
        }
    }
}

/// `out[i] = sum_s parts[s * len + i]`: the splits of a split-K GEMM, 4 values per unit.
#[cube(launch_unchecked)]
pub fn sum_splits_kernel(
    parts: &Array<Vector<f32, Const<4>>>,
    out: &mut Array<Vector<f32, Const<4>>>,
    len4: u32,
    splits: u32,
) {
    let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * 256 + UNIT_POS_X as usize;
    if i < len4 as usize {
        let mut acc = parts[i];
        for s in 1..splits as usize {
            acc += parts[s * len4 as usize + i];
        }
        out[i] = acc;
    }
}
