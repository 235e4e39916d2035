//! MLA attention on the tensor cores (CUDA `mma.sync m16n8k16`, bf16 operands, f32
//! accumulators), in the split-KV ("flash decoding") form.
//!
//! A request's query rows are its `(token, head)` pairs in order, `row = i * heads + h`; a
//! cube owns [`ROWS`] consecutive rows of one request and one contiguous range of its KV
//! chunks (a split), so the KV rows it reads serve all its rows at once (16 heads per read
//! instead of one) and a long context spreads over many cubes. Cubes of the same split and
//! request run side by side (the row group is the grid's fastest axis), so a KV chunk read
//! by the 4 row groups of 64 heads comes from L2 after the first.
//!
//! Per chunk of [`CHUNK`] KV positions (4 warps, 128 units):
//! 1. the chunk's rows arrive in shared memory by cp.async: bf16 rows into a ring of 5
//!    half-chunk slots, issued a chunk and a half ahead (at 2 cubes per SM, one chunk of
//!    lead left the loads short of bandwidth); fp8 rows one chunk ahead into a staging
//!    buffer, decoded at the end of the previous chunk into the other of two bf16 operand
//!    buffers, so fp8 costs no extra barrier (`kv_chunks.rs`);
//! 2. each warp computes the 16 x 32 scores over its quarter of the 576 dimensions (128
//!    of the latent and 16 of the rope part), its query fragments held in registers for
//!    the whole kernel, and stores them;
//! 3. 8 units per row sum the quarters, mask causally, and run the online softmax
//!    (running max and sum per row, `plane_shuffle_xor` within the 8 units), writing the
//!    weights as bf16 and each row's rescale factor;
//! 4. each warp rescales its accumulators and adds weights x values for its 128 of the 512
//!    output dimensions (values read with `ldmatrix.trans`).
//!
//! With one split the cube writes the normalised output; with several it writes its
//! unnormalised sums and its rows' (max, sum), and `combine.rs` merges the splits.
//!
//! fp8 (E4M3) values are exact in bf16: a code times its power-of-two tile scale is a bf16
//! number, so the decode only moves bits (`code * 2^-120`) and multiplies once by
//! `2^120 * scale` (bf16x2), storing each group of 4 latent dimensions in the order
//! (0, 2, 1, 3), which the queries' fragments and the output columns follow; from there
//! the chunk runs exactly as a bf16 one.
//!
//! Rounding: queries and softmax weights are rounded to bf16 for the tensor cores; bf16 KV
//! values and fp8 values are exact. `tolerance::attention_allowed` takes the operand type
//! and bounds what that adds.
use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use half::bf16;

use super::kv_chunks::{
    next_bf16_halves, next_fp8_chunk, start_bf16_ring, start_chunks, HalfRows, KvSpan,
    FP8_ROW_VECS, KV_STRIDE, RING_SLOTS,
};
use super::tree_mask::{sees, tree_window};
use super::KvFormat;
use crate::warp_mma::{Acc, Frag};

/// Query rows per cube (the MMA's M).
pub const ROWS: u32 = 16;
/// KV positions per step.
pub const CHUNK: u32 = 32;
/// Units per cube: 4 warps.
pub const UNITS: u32 = 128;
/// Shared-memory stride of a weight row, in bf16 (80 bytes: 5 vectors, odd).
const P_STRIDE: usize = 40;
/// Shared-memory stride of a score row, in f32.
const S_STRIDE: usize = 33;
/// Score k-steps (16 dimensions each) per warp: 8 of the latent, 1 of the rope part.
const K_STEPS: usize = 9;
/// Output n-tiles (8 dimensions each) per warp: 512 / 8 / 4.
const N_TILES: usize = 16;
/// Stands for minus infinity.
pub(super) const NEG_BIG: f32 = -3.0e38;

/// Compile-time shape of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaAttnConfig {
    pub format: KvFormat,
    /// One split: write the normalised output instead of partial sums.
    pub direct: bool,
    /// Queries carry draft-tree masks (`tree_masks`, one word per query token).
    pub tree: bool,
}

/// Grid: (row groups of the longest request, splits, batch); [`UNITS`] units.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn mma_attention_kernel(
    q: &Array<f32>,
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
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
    let row0 = CUBE_POS_X as usize * 16;

    if row0 < n_rows {
        let rows_here = min(16usize, n_rows - row0);
        let first_row = q_start * heads + row0;
        let last_pos = kv_len - q_len + (row0 + rows_here - 1) / heads;
        let chunks = last_pos / 32 + 1;
        let c_begin = chunks * split / splits;
        let c_end = chunks * (split + 1) / splits;

        let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
        let fp8 = comptime!(cfg.format == KvFormat::Fp8);
        // Operand buffers in half-chunk slots of 16 rows: bf16 a ring of 5, fp8 the two
        // halves of two chunk buffers.
        let slots = comptime!(if fp8 { 4 } else { RING_SLOTS });
        let mut kvs =
            SharedMemory::<Vector<bf16, Const<8>>>::new_aligned(slots * 16 * KV_STRIDE, 16usize);
        let mut staging = SharedMemory::<Vector<u32, Const<4>>>::new_aligned(
            comptime!(if fp8 { 32 * FP8_ROW_VECS } else { 1 }),
            16usize,
        );
        let mut ss = SharedMemory::<f32>::new(4 * 16 * S_STRIDE);
        let mut ps = SharedMemory::<bf16>::new_aligned(16 * P_STRIDE, 16usize);
        let mut alpha_s = SharedMemory::<f32>::new(16usize);

        // Rows are copied with cp.async ahead of their use: bf16 rows straight into a ring
        // of half-chunk slots, a chunk and a half ahead; fp8 rows one chunk ahead into one
        // staging buffer, decoded into the other operand buffer at the end of the chunk
        // before, then the next copy starts. Rows are looked up in the block table an
        // iteration before their copy. The first copies start before the queries load.
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
        let mut next_row = 0usize;
        let mut halves = HalfRows::new();
        if fp8 {
            next_row = start_chunks(
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
        } else {
            start_bf16_ring(
                kv_vecs,
                &mut kvs,
                &bar_a,
                &bar_b,
                block_table,
                &span,
                &mut halves,
                unit,
                units,
            );
        }

        // This warp's query fragments (A, 16 rows x 16 dims per k-step), from global memory.
        let mut qa = Array::<Frag>::new(comptime!(K_STEPS * 4));
        #[unroll]
        for j in 0usize..K_STEPS {
            let mut k0 = 512usize + warp * 16;
            if comptime!(j < 8) {
                k0 = warp * 128 + j * 16;
            }
            #[unroll]
            for r in 0..4usize {
                let row = g + (r % 2) * 8;
                // Fragment columns 2t, 2t + 1 (+ 8): dimensions k0 + 8h + 2t + (0, 1), or
                // for fp8's latent, stored as (0, 2, 1, 3) per 4, k0 + 8h + 4(t / 2) + t % 2
                // + (0, 2).
                let mut col = k0 + (r / 2) * 8 + 2 * t;
                let mut next = 1usize;
                if comptime!(fp8 && j < 8) {
                    col = k0 + (r / 2) * 8 + 4 * (t / 2) + t % 2;
                    next = 2usize;
                }
                let mut v = Frag::empty();
                v[0] = bf16::cast_from(0.0f32);
                v[1] = bf16::cast_from(0.0f32);
                if row < rows_here {
                    let base = (first_row + row) * 576 + col;
                    v[0] = bf16::cast_from(q[base]);
                    v[1] = bf16::cast_from(q[base + next]);
                }
                qa[j * 4 + r] = v;
            }
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
        let mut acc = Array::<Acc>::new(comptime!(N_TILES * 2));
        #[unroll]
        for i in 0usize..N_TILES * 2 {
            acc[i] = Acc::new(0.0);
        }
        // The softmax state of row `unit / 8` (its 8 units agree on it).
        let srow = unit / 8;
        let part = unit % 8;
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
        for c in c_begin..c_end {
            // 1. The chunk's KV rows in shared memory as bf16. Positions past the last are
            // read from the last row (finite values, weighted 0 below).
            let buf = (c - c_begin) % 2;
            if !fp8 {
                next_bf16_halves(
                    kv_vecs,
                    &mut kvs,
                    &bar_a,
                    &bar_b,
                    block_table,
                    &span,
                    c,
                    &mut halves,
                    unit,
                    units,
                );
            }
            // The chunk's two halves (positions 0..16, 16..32) in their slots.
            let half_at = (c - c_begin) * 2;
            let kb0 = (half_at % slots) * 16 * KV_STRIDE;
            let kb1 = ((half_at + 1) % slots) * 16 * KV_STRIDE;

            // 2. Scores over this warp's dimensions: 4 n-tiles of 8 positions.
            #[unroll]
            for nt in 0..4usize {
                let mut s = Array::<Acc>::new(2usize);
                s[0] = Acc::new(0.0);
                s[1] = Acc::new(0.0);
                #[unroll]
                for j in 0usize..K_STEPS {
                    let mut vec0 = 64usize + warp * 2;
                    if comptime!(j < 8) {
                        vec0 = warp * 16 + j * 2;
                    }
                    let mut kb = kb1;
                    if comptime!(nt < 2) {
                        kb = kb0;
                    }
                    let at = kb + ((nt % 2) * 8 + lane % 8) * KV_STRIDE + vec0 + (lane / 8) % 2;
                    let kf = mma.load_matrix::<Vector<bf16, Const<8>>, Const<2>>(
                        &kvs.slice(at, at + 1),
                        cmma::MatrixIdent::B,
                        2usize,
                        false,
                    );
                    let mut a = Array::<Frag>::new(4usize);
                    #[unroll]
                    for r in 0..4usize {
                        a[r] = qa[j * 4 + r];
                    }
                    mma.execute_inplace(&a, &kf, &mut s);
                }
                #[unroll]
                for half in 0..2usize {
                    let base = warp * 16 * S_STRIDE + (g + half * 8) * S_STRIDE + nt * 8 + 2 * t;
                    ss[base] = s[half][0];
                    ss[base + 1] = s[half][1];
                }
            }
            sync_cube();

            // 3. Online softmax: 8 units per row, 4 positions each.
            let mut sv = Array::<f32>::new(4usize);
            let mut local_max = f32::new(NEG_BIG);
            #[unroll]
            for e in 0..4usize {
                let col = part * 4 + e;
                let at = srow * S_STRIDE + col;
                let score = (ss[at]
                    + ss[at + 16 * S_STRIDE]
                    + ss[at + 32 * S_STRIDE]
                    + ss[at + 48 * S_STRIDE])
                    * softmax_scale;
                let visible = row_valid && sees(c * 32 + col, row_pos, window, row_mask, cfg.tree);
                sv[e] = select(visible, score, NEG_BIG);
                local_max = max(local_max, sv[e]);
            }
            local_max = max(local_max, plane_shuffle_xor(local_max, 1));
            local_max = max(local_max, plane_shuffle_xor(local_max, 2));
            local_max = max(local_max, plane_shuffle_xor(local_max, 4));
            let m_new = max(m_run, local_max);
            let alpha = (m_run - m_new).exp();
            let mut local_sum = 0.0f32;
            #[unroll]
            for e in 0..4usize {
                let p = select(sv[e] > NEG_BIG, (sv[e] - m_new).exp(), 0.0);
                local_sum += p;
                ps[srow * P_STRIDE + part * 4 + e] = bf16::cast_from(p);
            }
            local_sum += plane_shuffle_xor(local_sum, 1);
            local_sum += plane_shuffle_xor(local_sum, 2);
            local_sum += plane_shuffle_xor(local_sum, 4);
            l_run = l_run * alpha + local_sum;
            m_run = m_new;
            if part == 0 {
                alpha_s[srow] = alpha;
            }
            sync_cube();

            // 4. Rescale, then add weights x values for this warp's 128 output dimensions.
            let a_lo = Acc::new(alpha_s[g]);
            let a_hi = Acc::new(alpha_s[g + 8]);
            #[unroll]
            for n in 0usize..N_TILES {
                acc[n * 2] = acc[n * 2] * a_lo;
                acc[n * 2 + 1] = acc[n * 2 + 1] * a_hi;
            }
            #[unroll]
            for kk in 0..2usize {
                let mut pa = Array::<Frag>::new(4usize);
                let prow = ((lane / 8) % 2) * 8 + lane % 8;
                let pat = prow * P_STRIDE + kk * 16 + (lane / 16) * 8;
                let m = mma.load_matrix::<bf16, Const<2>>(
                    &ps.slice(pat, pat + 8),
                    cmma::MatrixIdent::A,
                    4usize,
                    false,
                );
                #[unroll]
                for r in 0..4usize {
                    pa[r] = m[r];
                }
                #[unroll]
                for np in 0usize..N_TILES / 2 {
                    let mut kb = kb1;
                    if comptime!(kk == 0) {
                        kb = kb0;
                    }
                    let kv_r = ((lane / 8) % 2) * 8 + lane % 8;
                    let vat = kb + kv_r * KV_STRIDE + warp * 16 + np * 2 + lane / 16;
                    let vb = mma.load_matrix::<Vector<bf16, Const<8>>, Const<2>>(
                        &kvs.slice(vat, vat + 1),
                        cmma::MatrixIdent::B,
                        4usize,
                        true,
                    );
                    #[unroll]
                    for half in 0..2usize {
                        let mut bfrag = Array::<Frag>::new(2usize);
                        bfrag[0] = vb[half * 2];
                        bfrag[1] = vb[half * 2 + 1];
                        let n = np * 2 + half;
                        let mut c_frag = Array::<Acc>::new(2usize);
                        c_frag[0] = acc[n * 2];
                        c_frag[1] = acc[n * 2 + 1];
                        mma.execute_inplace(&pa, &bfrag, &mut c_frag);
                        acc[n * 2] = c_frag[0];
                        acc[n * 2 + 1] = c_frag[1];
                    }
                }
            }
            // fp8: the next chunk into the other operand buffer (read last in the chunk
            // before) and the copy of the one after; bf16: every unit done with this buffer
            // before the next chunk's copy overwrites it.
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
            } else {
                sync_cube();
            }
        }

        // Each row's (max, sum) for the warps, and for the combine.
        let mut ml_s = SharedMemory::<f32>::new(32usize);
        if part == 0 {
            ml_s[srow * 2] = m_run;
            ml_s[srow * 2 + 1] = l_run;
            if !cfg.direct && row_valid {
                let at = (split * total_rows as usize + first_row + srow) * 2;
                part_ml[at] = m_run;
                part_ml[at + 1] = l_run;
            }
        }
        sync_cube();
        #[unroll]
        for half in 0..2usize {
            let r = g + half * 8;
            if r < rows_here {
                let mut scale = Acc::new(1.0);
                if cfg.direct {
                    scale = Acc::new(1.0 / ml_s[r * 2 + 1]);
                }
                let dst_row = select(
                    cfg.direct,
                    first_row + r,
                    split * total_rows as usize + first_row + r,
                );
                #[unroll]
                for n in 0usize..N_TILES {
                    let v = acc[n * 2 + half] * scale;
                    // Columns 2t, 2t + 1; fp8 stores dimensions (0, 2, 1, 3) per 4.
                    let mut d = dst_row * 512 + warp * 128 + n * 8 + 2 * t;
                    let mut next = 1usize;
                    if fp8 {
                        d = dst_row * 512 + warp * 128 + n * 8 + 4 * (t / 2) + t % 2;
                        next = 2usize;
                    }
                    if cfg.direct {
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
