//! [`super::absorb_query`] and [`super::project_values`] on the tensor cores (CUDA `mma.sync
//! m16n8k16`, bf16 operands, f32 accumulators): per head, a `[tokens, K] x [K, N]` product.
//!
//! - absorb: `A` = the head's `q_nope` (`K = nope`), `W[k][n] = kv_b[h * (nope + v) + k][n]`
//!   (`N = 512`, stored k-major: `ldmatrix.trans` hands out its B fragments); the cubes of the
//!   first column tile also copy `q_pe` into columns 512..576, rotated;
//! - project: `A` = the head's latent (`K = 512`), `W[k][n] = kv_b[h * (nope + v) + nope +
//!   n][k]` (`N = v`, stored n-major like a GEMM's weight rows).
//!
//! A cube computes [`BM`] tokens x [`BN`] columns of one head with 8 warps of 32 x 32 (the
//! tiling of `crate::gemm`'s tiled kernel), one [`BK`] step of both operands in shared
//! memory at a time, the next step's loads issued before this step's MMAs. K past `nope`
//! reads as zeros (`nope % 16 == 0`). Activations are rounded to bf16; the weights already
//! are bf16.
use cubecl::prelude::*;
use half::bf16;

use crate::rope::rotate_pair;
use crate::warp_mma::{load_a_tile, mma_step, Acc, Bf16x8, Frag};

/// Tokens per cube.
const BM: usize = 64;
/// Output columns per cube.
pub(super) const BN: usize = 128;
/// K per shared-memory step.
const BK: usize = 64;
/// 8 warps.
pub(super) const UNITS: u32 = 256;
/// Row stride (16-byte vectors) of the `[rows][BK]` tiles: 8 per row, plus one so the 8 rows
/// an `ldmatrix` reads fall in distinct bank groups.
const STRIDE: usize = 9;
/// Row stride of the k-major weight tile `[BK][BN]`: 16 vectors, plus one.
const STRIDE_T: usize = 17;

/// Grid: (ceil(tokens / BM), ceil(N / BN), heads); [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(super) fn head_product_kernel(
    a: &Array<Vector<f32, Const<4>>>,
    kv_b: &Array<Vector<u32, Const<4>>>,
    out: &mut Array<f32>,
    positions: &Array<u32>,
    inv_freq: &Array<f32>,
    tokens: u32,
    heads: u32,
    nope: u32,
    v: u32,
    rope_scale: f32,
    #[comptime] absorb: bool,
) {
    let unit = UNIT_POS_X as usize;
    let warp = unit / 32;
    let lane = unit % 32;
    let g = lane / 4;
    let t = lane % 4;
    let h = CUBE_POS_Z as usize;
    let heads = heads as usize;
    let nope = nope as usize;
    let v = v as usize;
    let tokens = tokens as usize;
    let tok0 = CUBE_POS_X as usize * BM;
    let n0 = CUBE_POS_Y as usize * BN;
    // This product's shapes: A rows `a_width` wide of which K are read; N outputs into rows
    // `out_width` wide.
    let mut a_width = 512usize;
    let mut k = 512usize;
    let mut n = v;
    let mut out_width = v;
    let mut w_row0 = h * (nope + v) + nope;
    if comptime!(absorb) {
        a_width = nope + 64;
        k = nope;
        n = 512usize;
        out_width = 576usize;
        w_row0 = h * (nope + v);
    }

    let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let mut a_s = SharedMemory::<Bf16x8>::new_aligned(BM * STRIDE, 16usize);
    let mut w_s = SharedMemory::<Bf16x8>::new_aligned(BN * STRIDE, 16usize);
    let wm = warp / 4;
    let wn = warp % 4;
    let mut acc = Array::<Acc>::new(16usize);
    #[unroll]
    for i in 0..16usize {
        acc[i] = Acc::new(0.0);
    }
    // Activations: row `unit / 4`, 16 values at `(unit % 4) * 16` of each step.
    let a_row = (min(tok0 + unit / 4, tokens - 1) * heads + h) * a_width;
    let mut a_raw = Array::<Vector<f32, Const<4>>>::new(4usize);
    let mut w_raw = Array::<Vector<u32, Const<4>>>::new(4usize);
    let steps = k.div_ceil(BK);
    load_step(
        a, kv_b, &mut a_raw, &mut w_raw, a_row, w_row0, k, n, n0, 0, unit, absorb,
    );
    for kt in 0..steps {
        #[unroll]
        for hh in 0..2usize {
            let mut x = Bf16x8::empty();
            #[unroll]
            for e in 0..8usize {
                x[e] = bf16::cast_from(a_raw[2 * hh + e / 4][e % 4]);
            }
            a_s[(unit / 4) * STRIDE + (unit % 4) * 2 + hh] = x;
        }
        #[unroll]
        for j in 0..4usize {
            let x = Bf16x8::reinterpret(w_raw[j]);
            if comptime!(absorb) {
                // k row `unit / 4`, columns `(unit % 4) * 32..` of the k-major tile.
                w_s[(unit / 4) * STRIDE_T + (unit % 4) * 4 + j] = x;
            } else {
                // n row `unit / 2`, k values `(unit % 2) * 32..`.
                w_s[(unit / 2) * STRIDE + (unit % 2) * 4 + j] = x;
            }
        }
        sync_cube();
        load_step(
            a,
            kv_b,
            &mut a_raw,
            &mut w_raw,
            a_row,
            w_row0,
            k,
            n,
            n0,
            min(kt + 1, steps - 1),
            unit,
            absorb,
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
                // Matrix `lane / 8` of the four: n rows 0..8 (k low, k high), then n rows
                // 8..16 (k low, k high).
                let at = if comptime!(absorb) {
                    // Rows are k here: lane gives k row `(lane / 8) % 2 * 8 + lane % 8` at
                    // n vector `lane / 16`; the transposing load yields the same fragments.
                    (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * STRIDE_T
                        + wn * 4
                        + np * 2
                        + lane / 16
                } else {
                    (wn * 32 + np * 16 + (lane / 16) * 8 + lane % 8) * STRIDE
                        + ks * 2
                        + (lane / 8) % 2
                };
                let bf = mma.load_matrix::<Bf16x8, Const<2>>(
                    &w_s.slice(at, at + 1),
                    cmma::MatrixIdent::B,
                    4usize,
                    comptime!(absorb),
                );
                let mut b = Array::<Frag>::new(4usize);
                #[unroll]
                for i in 0..4usize {
                    b[i] = bf[i];
                }
                #[unroll]
                for half in 0..2usize {
                    #[unroll]
                    for mt in 0..2usize {
                        let c = comptime!((mt * 4 + np * 2 + half) * 2);
                        mma_step(&af, comptime!(mt * 4), &b, comptime!(half * 2), &mut acc, c);
                    }
                }
            }
        }
        sync_cube();
    }

    #[unroll]
    for mt in 0..2usize {
        #[unroll]
        for nt in 0..4usize {
            #[unroll]
            for half in 0..2usize {
                let token = tok0 + wm * 32 + mt * 16 + g + half * 8;
                let col = n0 + wn * 32 + nt * 8 + 2 * t;
                let x = acc[(mt * 4 + nt) * 2 + half];
                let base = (token * heads + h) * out_width + col;
                if token < tokens {
                    if col < n {
                        out[base] = x[0];
                    }
                    if col + 1 < n {
                        out[base + 1] = x[1];
                    }
                }
            }
        }
    }
    if comptime!(absorb) {
        // `q_pe` (64 values after `nope`) goes to columns 512..576 rotated: a unit takes
        // 4 of them (pairs `2 (i % 16)`, `+ 1`) of one token.
        if CUBE_POS_Y == 0 {
            for i in range_stepped(unit, BM * 16, UNITS as usize) {
                let token = tok0 + i / 16;
                if token < tokens {
                    let row = token * heads + h;
                    let x = a[(row * a_width + nope) / 4 + i % 16];
                    let pos = positions[token];
                    #[unroll]
                    for p in 0..2usize {
                        let pair = (i % 16) * 2 + p;
                        let r =
                            rotate_pair(x[2 * p], x[2 * p + 1], pos, inv_freq[pair], rope_scale);
                        out[row * 576 + 512 + 2 * pair] = r[0];
                        out[row * 576 + 513 + 2 * pair] = r[1];
                    }
                }
            }
        }
    }
}

/// This unit's raw operands of K step `kt`: 16 activations (4 vectors; zeros past K) and
/// 32 bf16 weights (4 vectors; absorb: 32 columns of k row `unit / 4`, zeros past K;
/// project: 32 k values of n row `unit / 2`, clamped to the last row past N).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_step(
    a: &Array<Vector<f32, Const<4>>>,
    kv_b: &Array<Vector<u32, Const<4>>>,
    a_raw: &mut Array<Vector<f32, Const<4>>>,
    w_raw: &mut Array<Vector<u32, Const<4>>>,
    a_row: usize,
    w_row0: usize,
    k: usize,
    n: usize,
    n0: usize,
    kt: usize,
    unit: usize,
    #[comptime] absorb: bool,
) {
    let kk = kt * BK + (unit % 4) * 16;
    #[unroll]
    for i in 0..4usize {
        let mut x = Vector::<f32, Const<4>>::new(0.0);
        if kk < k {
            x = a[(a_row + kk) / 4 + i];
        }
        a_raw[i] = x;
    }
    if comptime!(absorb) {
        let d = kt * BK + unit / 4;
        #[unroll]
        for j in 0..4usize {
            let mut x = Vector::<u32, Const<4>>::new(0);
            if d < k {
                x = kv_b[((w_row0 + d) * 512 + n0 + (unit % 4) * 32) / 8 + j];
            }
            w_raw[j] = x;
        }
    } else {
        let row = w_row0 + min(n0 + unit / 2, n - 1);
        #[unroll]
        for j in 0..4usize {
            w_raw[j] = kv_b[(row * 512 + kt * BK + (unit % 2) * 32) / 8 + j];
        }
    }
}
