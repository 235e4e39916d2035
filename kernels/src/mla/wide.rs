//! MLA attention on the tensor cores with [`ROWS`] = 64 query rows per cube: all 64 heads
//! of a decode token (Kimi-K2), or several tokens of fewer heads. Where the 16-row kernel
//! (`mma.rs`) runs 4 cubes over the same KV rows for 64 heads, each doing its own barriers
//! and softmax per chunk, this cube reads a chunk once and feeds 4x the MMAs per barrier.
//! The split-KV form, partial outputs and the combine pass are `mma.rs`'s; the KV chunks'
//! copies and the exact fp8 decode (after which a chunk runs as a bf16 one) are
//! `kv_chunks.rs`'s, shared.
//!
//! Per chunk of 32 KV positions (8 warps, 256 units):
//! 1. the chunk's rows arrive in shared memory by cp.async, issued one chunk ahead (fp8:
//!    decoded at the end of the chunk before); waiting for them is also the barrier after
//!    the previous chunk;
//! 2. warp `w` scores rows `32 (w / 4)..+32` (two 16-row tiles) over quarter `w % 4` of
//!    the 576 dimensions (128 of the latent, 16 of the rope part) for all 32 positions,
//!    its query fragments read from shared memory (the cube's queries, bf16, stored once:
//!    64 rows x 576 would take 72 registers per unit next to the 128 of the output), and
//!    stores the partial scores;
//! 3. 4 units per row sum the quarters, mask causally, run the online softmax and write the
//!    weights as bf16 and each row's rescale factor;
//! 4. warp `w` rescales (unless no row's maximum moved) and adds weights x values for all
//!    64 rows over output dimensions `64 w..+64`, so each value fragment it loads feeds 4
//!    MMAs (128 accumulators a unit).
//!
//! Rounding as in `mma.rs`: queries and softmax weights are rounded to bf16.
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use half::bf16;

use super::kv_chunks::{
    copy_bf16_row, next_fp8_chunk, start_chunks, KvSpan, FP8_ROW_VECS, KV_STRIDE, ROW_VECS,
};
use super::mma::{MmaAttnConfig, NEG_BIG};
use super::tree_mask::{sees, tree_window};
use super::KvFormat;
use crate::warp_mma::{load_a_tile, mma_step, Acc, Bf16x8 as Vec8, Frag};

/// Query rows per cube.
pub const ROWS: u32 = 64;
/// Units per cube: 8 warps.
pub const UNITS: u32 = 256;
/// Shared-memory stride of a query row in 16-byte vectors (odd, like [`KV_STRIDE`]).
const Q_STRIDE: usize = 73;
/// Shared-memory stride of a weight row in 16-byte vectors (80 bytes: the 8 rows an
/// `ldmatrix` reads fall in distinct bank groups).
const P_STRIDE: usize = 5;
/// Shared-memory stride of a partial-score row, in pairs of f32 (34 words: the 4 pairs
/// a softmax unit reads per row fall in distinct banks across its half-warp).
const S_STRIDE: usize = 17;

/// Grid: (64-row groups of the longest request, splits, batch); [`UNITS`] units. Fast
/// `exp` (`__expf`): its error is far below the bf16 rounding of the weights it feeds.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
pub fn wide_attention_kernel(
    q: &Array<Vector<f32, Const<4>>>,
    kv_vecs: &Array<Vec8>,
    kv_raw: &Array<Vector<u32, Const<4>>>,
    block_table: &Array<u32>,
    cu_q_lens: &Array<u32>,
    kv_lens: &Array<u32>,
    tree_masks: &Array<u32>,
    out: &mut Array<f32>,
    part_out: &mut Array<f32>,
    part_ml: &mut Array<f32>,
    heads: u32,
    max_blocks: u32,
    page_size: u32,
    total_rows: u32,
    softmax_scale: f32,
    #[comptime] cfg: MmaAttnConfig,
) {
    let unit = UNIT_POS_X as usize;
    let warp = unit / 32;
    let lane = unit % 32;
    let g = lane / 4;
    let t = lane % 4;
    let b = CUBE_POS_Z as usize;
    let split = CUBE_POS_Y as usize;
    let splits = CUBE_COUNT_Y as usize;
    let heads = heads as usize;
    let q_start = cu_q_lens[b] as usize;
    let q_len = cu_q_lens[b + 1] as usize - q_start;
    let kv_len = kv_lens[b] as usize;
    let n_rows = q_len * heads;
    let row0 = CUBE_POS_X as usize * 64;

    if row0 < n_rows {
        let rows_here = min(64usize, n_rows - row0);
        let first_row = q_start * heads + row0;
        let last_pos = kv_len - q_len + (row0 + rows_here - 1) / heads;
        let chunks = last_pos / 32 + 1;
        let c_begin = chunks * split / splits;
        let c_end = chunks * (split + 1) / splits;

        let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
        let fp8 = comptime!(cfg.format == KvFormat::Fp8);
        let direct = comptime!(cfg.direct);
        let mut qs = SharedMemory::<Vec8>::new_aligned(64 * Q_STRIDE, 16usize);
        let mut kvs = SharedMemory::<Vec8>::new_aligned(2 * 32 * KV_STRIDE, 16usize);
        let mut staging = SharedMemory::<Vector<u32, Const<4>>>::new_aligned(
            comptime!(if fp8 { 32 * FP8_ROW_VECS } else { 1 }),
            16usize,
        );
        let mut ss = SharedMemory::<Acc>::new(4 * 64 * S_STRIDE);
        let mut ps = SharedMemory::<Vec8>::new_aligned(64 * P_STRIDE, 16usize);
        let mut alpha_s = SharedMemory::<f32>::new(64usize);

        // Rows are copied with cp.async one chunk ahead. bf16: each unit's cache row looked
        // up a chunk before its copy; waiting for a chunk is also the barrier after the
        // previous chunk's last reads, so the copy into the other buffer starts after it.
        // fp8: rows go to one staging buffer, decoded at the end of the chunk before into the
        // other operand buffer (the wait for them is that chunk's barrier), then the copy of
        // the chunk after starts. The first copies start before the queries load.
        let bar_a = Barrier::shared(UNITS, unit == 0);
        let bar_b = Barrier::shared(UNITS, unit == 0);
        let span = KvSpan::new(
            c_begin,
            c_end,
            b * max_blocks as usize,
            last_pos,
            page_size as usize,
        );
        let units = comptime!(UNITS as usize);
        let mut next_row = start_chunks(
            kv_vecs,
            kv_raw,
            &mut kvs,
            &mut staging,
            &bar_a,
            block_table,
            &span,
            unit,
            units,
            cfg.format,
        );

        // The cube's queries as bf16 (rows past the last are zero).
        #[unroll]
        for i in 0..comptime!(64 * ROW_VECS / 256) {
            let idx = unit + i * 256;
            let r = idx / ROW_VECS;
            let v = idx % ROW_VECS;
            let mut vec = Vec8::empty();
            #[unroll]
            for e in 0..8usize {
                vec[e] = bf16::cast_from(0.0f32);
            }
            if r < rows_here {
                let base = (first_row + r) * 144 + v * 2;
                #[unroll]
                for h in 0..2usize {
                    let x = q[base + h];
                    // fp8's latent is stored as dimensions (0, 2, 1, 3) per 4.
                    if fp8 && v < 64 {
                        vec[h * 4] = bf16::cast_from(x[0]);
                        vec[h * 4 + 1] = bf16::cast_from(x[2]);
                        vec[h * 4 + 2] = bf16::cast_from(x[1]);
                        vec[h * 4 + 3] = bf16::cast_from(x[3]);
                    } else {
                        #[unroll]
                        for e in 0..4usize {
                            vec[h * 4 + e] = bf16::cast_from(x[e]);
                        }
                    }
                }
            }
            qs[r * Q_STRIDE + v] = vec;
        }
        if fp8 {
            // The first fp8 chunk, in flight since before the queries, into buffer 0.
            next_row = next_fp8_chunk(
                kv_raw,
                &mut kvs,
                &mut staging,
                &bar_a,
                block_table,
                &span,
                c_begin,
                0,
                next_row,
                unit,
                units,
            );
        }

        // Output accumulators: 4 row tiles x 8 n-tiles x (rows g, g + 8).
        let mut acc = Array::<Acc>::new(64usize);
        #[unroll]
        for i in 0..64usize {
            acc[i] = Acc::new(0.0);
        }
        // The softmax state of row `unit / 4` (its 4 units agree on it).
        let srow = unit / 4;
        let part = unit % 4;
        let row_valid = srow < rows_here;
        let row_token = (row0 + srow) / heads;
        let row_pos = kv_len - q_len + row_token;
        let mut row_mask = 0u32;
        if comptime!(cfg.tree) && row_valid {
            row_mask = tree_masks[q_start + row_token];
        }
        let window = tree_window(kv_len, q_len);
        let mut m_run = f32::new(NEG_BIG);
        let mut l_run = 0.0f32;
        // The score work of this warp: row tiles 2 rh, 2 rh + 1; dimension quarter kq.
        let rh = warp / 4;
        let kq = warp % 4;
        for c in c_begin..c_end {
            // 1. This chunk's rows in shared memory, then the next chunk's copy.
            let buf = (c - c_begin) % 2;
            if !fp8 {
                if buf == 0 {
                    bar_a.arrive_and_wait();
                } else {
                    bar_b.arrive_and_wait();
                }
                if c + 1 < c_end {
                    copy_bf16_row(kv_vecs, &mut kvs, 1 - buf, next_row, unit, units);
                    if buf == 0 {
                        bar_b.commit_copy_async();
                    } else {
                        bar_a.commit_copy_async();
                    }
                    next_row = span.row(block_table, c + 2, unit, units);
                }
            }
            let kb = buf * 32 * KV_STRIDE;

            // 2. Partial scores: 2 row tiles x 4 n-tiles over this warp's quarter, in 4
            // pairs of latent k-steps and one rope k-step.
            let mut s = Array::<Acc>::new(16usize);
            #[unroll]
            for i in 0..16usize {
                s[i] = Acc::new(0.0);
            }
            #[unroll]
            for jp in 0..5usize {
                let steps = comptime!(if jp < 4 { 2usize } else { 1usize });
                let mut vec0 = 64usize + kq * 2;
                if comptime!(jp < 4) {
                    vec0 = kq * 16 + jp * 4;
                }
                // A fragments [k-step][row tile], 4 registers each.
                let mut a = Array::<Frag>::new(16usize);
                #[unroll]
                for kk in 0..steps {
                    #[unroll]
                    for rt in 0..2usize {
                        let row0 = (rh * 2 + rt) * 16;
                        let at = comptime!((kk * 2 + rt) * 4);
                        load_a_tile(&qs, row0, vec0 + kk * 2, Q_STRIDE, lane, &mut a, at);
                    }
                }
                #[unroll]
                for nt in 0..4usize {
                    // B fragments of positions nt * 8.., one 8 x 8 matrix per 8 dimensions.
                    let mut kf = Array::<Frag>::new(4usize);
                    if comptime!(jp < 4) {
                        let at = kb + (nt * 8 + lane % 8) * KV_STRIDE + vec0 + lane / 8;
                        let m = mma.load_matrix::<Vec8, Const<2>>(
                            &kvs.slice(at, at + 1),
                            cmma::MatrixIdent::B,
                            4usize,
                            false,
                        );
                        #[unroll]
                        for r in 0..4usize {
                            kf[r] = m[r];
                        }
                    } else {
                        let at = kb + (nt * 8 + lane % 8) * KV_STRIDE + vec0 + (lane / 8) % 2;
                        let m = mma.load_matrix::<Vec8, Const<2>>(
                            &kvs.slice(at, at + 1),
                            cmma::MatrixIdent::B,
                            2usize,
                            false,
                        );
                        kf[0] = m[0];
                        kf[1] = m[1];
                    }
                    #[unroll]
                    for kk in 0..steps {
                        #[unroll]
                        for rt in 0..2usize {
                            let a_at = comptime!((kk * 2 + rt) * 4);
                            let c = comptime!((rt * 4 + nt) * 2);
                            mma_step(&a, a_at, &kf, comptime!(kk * 2), &mut s, c);
                        }
                    }
                }
            }
            #[unroll]
            for rt in 0..2usize {
                #[unroll]
                for nt in 0..4usize {
                    #[unroll]
                    for half in 0..2usize {
                        let row = (rh * 2 + rt) * 16 + g + half * 8;
                        ss[(kq * 64 + row) * S_STRIDE + nt * 4 + t] = s[(rt * 4 + nt) * 2 + half];
                    }
                }
            }
            sync_cube();

            // 3. Online softmax: 4 units per row, 8 positions each.
            let mut sv = Array::<f32>::new(8usize);
            let mut local_max = f32::new(NEG_BIG);
            #[unroll]
            for e in 0..4usize {
                let at = srow * S_STRIDE + part * 4 + e;
                let pair = (ss[at] + ss[at + 64 * S_STRIDE])
                    + (ss[at + 128 * S_STRIDE] + ss[at + 192 * S_STRIDE]);
                #[unroll]
                for h in 0..2usize {
                    let col = part * 8 + e * 2 + h;
                    let visible =
                        row_valid && sees(c * 32 + col, row_pos, window, row_mask, cfg.tree);
                    sv[e * 2 + h] = select(visible, pair[h] * softmax_scale, NEG_BIG);
                    local_max = max(local_max, sv[e * 2 + h]);
                }
            }
            local_max = max(local_max, plane_shuffle_xor(local_max, 1));
            local_max = max(local_max, plane_shuffle_xor(local_max, 2));
            let m_new = max(m_run, local_max);
            let alpha = (m_run - m_new).exp();
            let mut local_sum = 0.0f32;
            let mut pv = Array::<f32>::new(8usize);
            #[unroll]
            for e in 0..8usize {
                pv[e] = select(sv[e] > NEG_BIG, (sv[e] - m_new).exp(), 0.0);
                local_sum += pv[e];
            }
            let mut weights = Vec8::empty();
            #[unroll]
            for e in 0..8usize {
                weights[e] = bf16::cast_from(pv[e]);
            }
            ps[srow * P_STRIDE + part] = weights;
            local_sum += plane_shuffle_xor(local_sum, 1);
            local_sum += plane_shuffle_xor(local_sum, 2);
            l_run = l_run * alpha + local_sum;
            m_run = m_new;
            if part == 0 {
                alpha_s[srow] = alpha;
            }
            sync_cube();

            // 4. Rescale (skipped when no row of the warp's fragments has a new maximum:
            // then every factor is exactly 1), then add weights x values for all rows over
            // this warp's 64 output dimensions.
            let mut alphas = Array::<f32>::new(8usize);
            let mut unchanged = true;
            #[unroll]
            for i in 0..8usize {
                alphas[i] = alpha_s[(i / 2) * 16 + g + (i % 2) * 8];
                unchanged = unchanged && alphas[i] == 1.0;
            }
            if !plane_all(unchanged) {
                #[unroll]
                for rt in 0..4usize {
                    let a_lo = Acc::new(alphas[rt * 2]);
                    let a_hi = Acc::new(alphas[rt * 2 + 1]);
                    #[unroll]
                    for n in 0..8usize {
                        let i = (rt * 8 + n) * 2;
                        acc[i] = acc[i] * a_lo;
                        acc[i + 1] = acc[i + 1] * a_hi;
                    }
                }
            }
            #[unroll]
            for kk in 0..2usize {
                let mut pa = Array::<Frag>::new(16usize);
                #[unroll]
                for rt in 0..4usize {
                    load_a_tile(
                        &ps,
                        rt * 16,
                        kk * 2,
                        P_STRIDE,
                        lane,
                        &mut pa,
                        comptime!(rt * 4),
                    );
                }
                #[unroll]
                for np in 0..4usize {
                    let kv_r = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
                    let vat = kb + kv_r * KV_STRIDE + warp * 8 + np * 2 + lane / 16;
                    let vb = mma.load_matrix::<Vec8, Const<2>>(
                        &kvs.slice(vat, vat + 1),
                        cmma::MatrixIdent::B,
                        4usize,
                        true,
                    );
                    let mut b = Array::<Frag>::new(4usize);
                    #[unroll]
                    for i in 0..4usize {
                        b[i] = vb[i];
                    }
                    #[unroll]
                    for half in 0..2usize {
                        #[unroll]
                        for rt in 0..4usize {
                            let c = comptime!((rt * 8 + np * 2 + half) * 2);
                            mma_step(&pa, comptime!(rt * 4), &b, comptime!(half * 2), &mut acc, c);
                        }
                    }
                }
            }
            // fp8: the next chunk has landed in staging (every unit done with this chunk);
            // decode it into the other operand buffer, then start the copy of the one after.
            if fp8 {
                next_row = next_fp8_chunk(
                    kv_raw,
                    &mut kvs,
                    &mut staging,
                    &bar_a,
                    block_table,
                    &span,
                    c + 1,
                    1 - buf,
                    next_row,
                    unit,
                    units,
                );
            }
        }

        // Each row's (max, sum) for the warps, and for the combine.
        let mut ml_s = SharedMemory::<f32>::new(128usize);
        if part == 0 {
            ml_s[srow * 2] = m_run;
            ml_s[srow * 2 + 1] = l_run;
            if !direct && row_valid {
                let at = (split * total_rows as usize + first_row + srow) * 2;
                part_ml[at] = m_run;
                part_ml[at + 1] = l_run;
            }
        }
        sync_cube();
        #[unroll]
        for rt in 0..4usize {
            #[unroll]
            for half in 0..2usize {
                let r = rt * 16 + g + half * 8;
                if r < rows_here {
                    let mut scale = Acc::new(1.0);
                    if direct {
                        scale = Acc::new(1.0 / ml_s[r * 2 + 1]);
                    }
                    let dst_row = select(
                        direct,
                        first_row + r,
                        split * total_rows as usize + first_row + r,
                    );
                    #[unroll]
                    for n in 0..8usize {
                        let v = acc[(rt * 8 + n) * 2 + half] * scale;
                        // Columns 2t, 2t + 1; fp8 stores dimensions (0, 2, 1, 3) per 4.
                        let mut d = dst_row * 512 + warp * 64 + n * 8 + 2 * t;
                        let mut next = 1usize;
                        if fp8 {
                            d = dst_row * 512 + warp * 64 + n * 8 + 4 * (t / 2) + t % 2;
                            next = 2usize;
                        }
                        if direct {
                            out[d] = v[0];
                            out[d + next] = v[1];
                        } else {
                            part_out[d] = v[0];
                            part_out[d + next] = v[1];
                        }
                    }
                }
            }
        }
    }
}
