//! The per-head MLA prefill attention (`heads.rs`) on the tensor cores: `mma.sync
//! m16n8k16` with bf16 operands and f32 accumulators, in FlashAttention-2's shape.
//!
//! First [`pack`]: the expanded keys (each head's `nope` dims, then the shared rope part)
//! and values are rounded to bf16 into head-major arrays, `[heads, context rows, nope + 64]`
//! and `[heads, context rows, v]`, so a head's tile of positions is one contiguous block.
//!
//! Then a cube of [`ROWS`] / 16 warps owns [`ROWS`] consecutive query tokens of one head of
//! one request (warp `w` its tokens `16 w..16 w + 16`), the query fragments in registers for
//! the whole kernel. Per tile of [`TILE`] positions:
//! 1. the tile's keys and values arrive in shared memory by cp.async, issued one tile ahead
//!    into the other of two buffers (positions past the last one the cube sees in the chunk
//!    read that one again: finite values, weighted 0);
//! 2. each warp scores its 16 tokens against the 64 positions (`ldmatrix.x4` of the keys: two
//!    k-steps a load);
//! 3. the online softmax runs in registers: a unit holds two rows' running max and its own
//!    share of their sums (the 4 units of a row agree on the max by `plane_shuffle_xor`; the
//!    sums are added only at the end), the mask only on tiles that cross a row's diagonal
//!    or the chunk's end;
//! 4. the weights, rounded to bf16, are already the A fragments of weights x values (the
//!    score accumulators of two n-tiles are one k-step's A operand), and the values come in
//!    by `ldmatrix.trans`.
//!
//! No barrier inside a tile's math: a warp's rows are its own. The query blocks of a request
//! are issued last block first, so the longest cubes (causal) start first. A launch attends
//! one chunk of the context (`heads.rs`'s `ContextRows`): after the first it starts from
//! the output and log-sum-exp the chunk before left, and before the last it leaves them.
//!
//! Rounding: queries, keys, values and the softmax weights are rounded to bf16 for the
//! tensor cores; `tolerance::attention_allowed` with bf16 operands bounds the first three's
//! effect on scores and weights, and the values' rounding adds `u_bf16` of their magnitude.
use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;
use half::bf16;

use super::absorb::KvBShape;
use super::cache_write::bf16_bits;
use super::heads::Resume;
use super::mma::NEG_BIG;
use super::{uses_tensor_cores, KvFormat};
use crate::cuda_source::{cuda_source, input, output, scalar};
use crate::warp_mma::{Acc, Bf16x8, Frag};
use crate::{DeviceArray, KernelError, Precision};

/// Query tokens per cube: 16 per warp. 64 is the measured configuration (RESULTS.md,
/// 2026-12-07); 128 (8 warps sharing each key/value tile, half the tiles' traffic per
/// product) compiles but has not run on a GPU.
pub const ROWS: u32 = 64;
/// Context positions per tile.
const TILE: usize = 64;
/// Units per cube: a warp per 16 rows.
const UNITS: u32 = ROWS / 16 * 32;
/// Units per cube of the pack.
const PACK_UNITS: u32 = 64;
/// Width of the shared rope part.
const ROPE: usize = 64;

/// Compile-time shape: key (`nope + 64`) and value head dims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Dims {
    qk: u32,
    v: u32,
}

/// True when [`super::mla_prefill_heads`] attends on the tensor cores: a bf16 or fp8 cache
/// at `Bf16` precision on a device with bf16 `mma.sync` ([`uses_tensor_cores`]), `nope` a
/// multiple of 32 and `v` of 16 (whole `ldmatrix.x4` loads), both at most 256 (registers).
pub fn heads_on_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    format: KvFormat,
    precision: Precision,
    shape: KvBShape,
) -> bool {
    uses_tensor_cores(client, format, precision)
        && shape.nope.is_multiple_of(32)
        && shape.v.is_multiple_of(16)
        && shape.nope + ROPE <= 256
        && shape.v <= 256
}

/// Grid: (context rows, heads); [`PACK_UNITS`] units. Row `row` of head `head`: keys
/// (`nope` expanded dims, then the rope row) and values as bf16 pairs, head-major.
#[cube(launch_unchecked)]
fn pack_kernel(
    expanded: &Array<f32>,
    rope: &Array<f32>,
    keys: &mut Array<u32>,
    values: &mut Array<u32>,
    rows: u32,
    #[comptime] dims: Dims,
) {
    let row = CUBE_POS_X as usize;
    let head = CUBE_POS_Y as usize;
    let heads = CUBE_COUNT_Y as usize;
    let rows = rows as usize;
    let qk_words = comptime!(dims.qk as usize / 2);
    let v_words = comptime!(dims.v as usize / 2);
    let nope = comptime!(dims.qk as usize - ROPE);
    let src = (row * heads + head) * comptime!(dims.qk as usize - ROPE + dims.v as usize);
    for w in range_stepped(
        UNIT_POS_X as usize,
        comptime!(qk_words + v_words),
        PACK_UNITS as usize,
    ) {
        let key = (head * rows + row) * qk_words + w;
        let d = 2 * w;
        if d < nope {
            keys[key] = bf16_bits(expanded[src + d]) | (bf16_bits(expanded[src + d + 1]) << 16);
        } else if w < qk_words {
            let at = row * ROPE + d - nope;
            keys[key] = bf16_bits(rope[at]) | (bf16_bits(rope[at + 1]) << 16);
        } else {
            let i = w - qk_words;
            let at = src + nope + 2 * i;
            values[(head * rows + row) * v_words + i] =
                bf16_bits(expanded[at]) | (bf16_bits(expanded[at + 1]) << 16);
        }
    }
}

/// Starts this unit's cp.async copies of tile `c` of one head's rows (`row_vecs` 16-byte
/// vectors each, from row `first_row`; rows past `last_row` read that one) into buffer
/// `buf` of `smem` (rows at a stride of `stride` vectors).
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_tile(
    src: &Array<Bf16x8>,
    smem: &mut SharedMemory<Bf16x8>,
    first_row: usize,
    c: usize,
    last_row: usize,
    buf: usize,
    unit: usize,
    #[comptime] row_vecs: usize,
    #[comptime] stride: usize,
) {
    let whole = comptime!((TILE * row_vecs).is_multiple_of(UNITS as usize));
    #[unroll]
    for j in 0..comptime!((TILE * row_vecs).div_ceil(UNITS as usize)) {
        let idx = unit + j * UNITS as usize;
        if whole || idx < TILE * row_vecs {
            let r = idx / row_vecs;
            let vec = idx % row_vecs;
            let s = (first_row + min(c * TILE + r, last_row)) * row_vecs + vec;
            let d = (buf * TILE + r) * stride + vec;
            copy_async(&src.slice(s, s + 1), &mut smem.slice_mut(d, d + 1), 8u32);
        }
    }
}

/// Grid: ([`ROWS`]-token blocks of the longest request, heads, batch); [`UNITS`] units. Attends
/// positions `first_pos..` of the chunk whose rows `cu_rows` lays out. Fast `exp`
/// (`__expf`): its error is far below the bf16 rounding of the weights it feeds.
#[cube(
    launch_unchecked,
    fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf
)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel(
    q: &Array<f32>,
    keys: &Array<Bf16x8>,
    values: &Array<Bf16x8>,
    cu_q_lens: &Array<u32>,
    kv_lens: &Array<u32>,
    cu_rows: &Array<u32>,
    out: &mut Array<f32>,
    lse: &mut Array<f32>,
    rows: u32,
    first_pos: u32,
    softmax_scale: f32,
    #[comptime] dims: Dims,
    #[comptime] resume: Resume,
) {
    let k_vecs = comptime!(dims.qk as usize / 8);
    let v_vecs = comptime!(dims.v as usize / 8);
    // Odd strides: the 8 rows an `ldmatrix` reads fall in distinct bank groups.
    let k_stride = comptime!((dims.qk as usize / 8) | 1);
    let v_stride = comptime!((dims.v as usize / 8) | 1);
    let k_steps = comptime!(dims.qk as usize / 16);
    let n_tiles = comptime!(dims.v as usize / 8);
    let qk = comptime!(dims.qk as usize);
    let v_dim = comptime!(dims.v as usize);

    let unit = UNIT_POS_X as usize;
    let warp = unit / 32;
    let lane = unit % 32;
    let g = lane / 4;
    let t = lane % 4;
    let head = CUBE_POS_Y as usize;
    let heads = CUBE_COUNT_Y as usize;
    let b = CUBE_POS_Z as usize;
    let rows = rows as usize;
    let q_start = cu_q_lens[b] as usize;
    let q_len = cu_q_lens[b + 1] as usize - q_start;
    let kv_len = kv_lens[b] as usize;
    let block = ROWS as usize;
    let blocks = (q_len + block - 1) / block;
    let x = CUBE_POS_X as usize;
    let first_pos = first_pos as usize;
    let mut end = first_pos;
    let mut first = 0usize;
    let mut rows_in_block = 0usize;
    let mut pos0 = 0usize;
    if x < blocks {
        first = (blocks - 1 - x) * block;
        rows_in_block = min(block, q_len - first);
        // Token i of the block sees positions 0..=pos0 + i; this chunk holds `first_pos..end`
        // of them.
        pos0 = kv_len - q_len + first;
        end = min(
            first_pos + cu_rows[b + 1] as usize - cu_rows[b] as usize,
            pos0 + rows_in_block,
        );
    }

    if end > first_pos {
        let tiles = (end - first_pos + TILE - 1) / TILE;
        let first_row = head * rows + cu_rows[b] as usize;
        let last_row = end - 1 - first_pos;

        let mma = cmma::MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
        let mut ks = SharedMemory::<Bf16x8>::new_aligned(2 * TILE * k_stride, 16usize);
        let mut vs = SharedMemory::<Bf16x8>::new_aligned(2 * TILE * v_stride, 16usize);
        let bar_a = Barrier::shared(UNITS, unit == 0);
        let bar_b = Barrier::shared(UNITS, unit == 0);
        copy_tile(
            keys, &mut ks, first_row, 0, last_row, 0, unit, k_vecs, k_stride,
        );
        copy_tile(
            values, &mut vs, first_row, 0, last_row, 0, unit, v_vecs, v_stride,
        );
        bar_a.commit_copy_async();

        // This warp's query fragments (A: 16 tokens x 16 dims per k-step).
        let mut qa = Array::<Frag>::new(comptime!(k_steps * 4));
        #[unroll]
        for j in 0..k_steps {
            #[unroll]
            for r in 0..4usize {
                let row = warp * 16 + g + (r % 2) * 8;
                let mut v = Frag::empty();
                v[0] = bf16::cast_from(0.0f32);
                v[1] = bf16::cast_from(0.0f32);
                if row < rows_in_block {
                    let at = ((q_start + first + row) * heads + head) * qk + j * 16 + (r / 2) * 8;
                    v[0] = bf16::cast_from(q[at + 2 * t]);
                    v[1] = bf16::cast_from(q[at + 2 * t + 1]);
                }
                qa[j * 4 + r] = v;
            }
        }

        let mut acc = Array::<Acc>::new(comptime!(n_tiles * 2));
        #[unroll]
        for i in 0..n_tiles * 2 {
            acc[i] = Acc::new(0.0);
        }
        // Rows g and g + 8 of this warp's 16: running max, and this unit's share of the sum.
        let lim_lo = pos0 + warp * 16 + g;
        let lim_hi = lim_lo + 8;
        let mut m_lo = f32::new(NEG_BIG);
        let mut m_hi = f32::new(NEG_BIG);
        let mut l_lo = 0.0f32;
        let mut l_hi = 0.0f32;
        let row_lo = warp * 16 + g;
        let at_lo = (q_start + first + row_lo) * heads + head;
        let at_hi = at_lo + 8 * heads;
        // The chunks before left the normalised output: weight 1 at their max (one unit of
        // the row's 4 holds the sum).
        if comptime!(resume.from_state) {
            let share = select(t == 0, 1.0f32, 0.0f32);
            if row_lo < rows_in_block {
                m_lo = lse[at_lo];
                l_lo = share;
                #[unroll]
                for n in 0..n_tiles {
                    let at = at_lo * v_dim + n * 8 + 2 * t;
                    let mut v = Acc::empty();
                    v[0] = out[at];
                    v[1] = out[at + 1];
                    acc[n * 2] = v;
                }
            }
            if row_lo + 8 < rows_in_block {
                m_hi = lse[at_hi];
                l_hi = share;
                #[unroll]
                for n in 0..n_tiles {
                    let at = at_hi * v_dim + n * 8 + 2 * t;
                    let mut v = Acc::empty();
                    v[0] = out[at];
                    v[1] = out[at + 1];
                    acc[n * 2 + 1] = v;
                }
            }
        }
        for c in 0..tiles {
            let buf = c % 2;
            // 1. The next tile into the other buffer (its last readers passed the barrier
            //    closing the tile before), then wait for this one.
            if c + 1 < tiles {
                let next = 1 - buf;
                copy_tile(
                    keys,
                    &mut ks,
                    first_row,
                    c + 1,
                    last_row,
                    next,
                    unit,
                    k_vecs,
                    k_stride,
                );
                copy_tile(
                    values,
                    &mut vs,
                    first_row,
                    c + 1,
                    last_row,
                    next,
                    unit,
                    v_vecs,
                    v_stride,
                );
                if buf == 0 {
                    bar_b.commit_copy_async();
                } else {
                    bar_a.commit_copy_async();
                }
            }
            if buf == 0 {
                bar_a.arrive_and_wait();
            } else {
                bar_b.arrive_and_wait();
            }
            let kb = buf * TILE * k_stride;
            let vb = buf * TILE * v_stride;

            // 2. Scores: 8 n-tiles of 8 positions, two k-steps per key load.
            let mut sc = Array::<f32>::new(32usize);
            #[unroll]
            for nt in 0..8usize {
                let mut s = Array::<Acc>::new(2usize);
                s[0] = Acc::new(0.0);
                s[1] = Acc::new(0.0);
                #[unroll]
                for j2 in 0..k_steps / 2 {
                    let at = kb + (nt * 8 + lane % 8) * k_stride + j2 * 4 + lane / 8;
                    let kf = mma.load_matrix::<Bf16x8, Const<2>>(
                        &ks.slice(at, at + 1),
                        cmma::MatrixIdent::B,
                        4usize,
                        false,
                    );
                    #[unroll]
                    for step in 0..2usize {
                        let mut a = Array::<Frag>::new(4usize);
                        #[unroll]
                        for r in 0..4usize {
                            a[r] = qa[(j2 * 2 + step) * 4 + r];
                        }
                        let mut bf = Array::<Frag>::new(2usize);
                        bf[0] = kf[step * 2];
                        bf[1] = kf[step * 2 + 1];
                        mma.execute_inplace(&a, &bf, &mut s);
                    }
                }
                #[unroll]
                for half in 0..2usize {
                    sc[(nt * 2 + half) * 2] = s[half][0] * softmax_scale;
                    sc[(nt * 2 + half) * 2 + 1] = s[half][1] * softmax_scale;
                }
            }

            // 3. Mask where the tile crosses a row's diagonal or the chunk's end, then the
            //    online softmax of rows g (lo) and g + 8 (hi).
            let tile_pos = first_pos + c * TILE;
            if tile_pos + TILE > min(end, pos0 + warp * 16 + 1) {
                #[unroll]
                for nt in 0..8usize {
                    #[unroll]
                    for e in 0..2usize {
                        let p = tile_pos + nt * 8 + 2 * t + e;
                        let lo = (nt * 2) * 2 + e;
                        let hi = (nt * 2 + 1) * 2 + e;
                        sc[lo] = select(p <= lim_lo && p < end, sc[lo], NEG_BIG);
                        sc[hi] = select(p <= lim_hi && p < end, sc[hi], NEG_BIG);
                    }
                }
            }
            let mut mx_lo = f32::new(NEG_BIG);
            let mut mx_hi = f32::new(NEG_BIG);
            #[unroll]
            for nt in 0..8usize {
                #[unroll]
                for e in 0..2usize {
                    mx_lo = max(mx_lo, sc[(nt * 2) * 2 + e]);
                    mx_hi = max(mx_hi, sc[(nt * 2 + 1) * 2 + e]);
                }
            }
            mx_lo = max(mx_lo, plane_shuffle_xor(mx_lo, 1));
            mx_lo = max(mx_lo, plane_shuffle_xor(mx_lo, 2));
            mx_hi = max(mx_hi, plane_shuffle_xor(mx_hi, 1));
            mx_hi = max(mx_hi, plane_shuffle_xor(mx_hi, 2));
            let new_lo = max(m_lo, mx_lo);
            let new_hi = max(m_hi, mx_hi);
            let alpha_lo = (m_lo - new_lo).exp();
            let alpha_hi = (m_hi - new_hi).exp();
            m_lo = new_lo;
            m_hi = new_hi;
            l_lo *= alpha_lo;
            l_hi *= alpha_hi;
            #[unroll]
            for nt in 0..8usize {
                #[unroll]
                for e in 0..2usize {
                    let lo = (nt * 2) * 2 + e;
                    let hi = (nt * 2 + 1) * 2 + e;
                    sc[lo] = select(sc[lo] > NEG_BIG, (sc[lo] - new_lo).exp(), 0.0);
                    sc[hi] = select(sc[hi] > NEG_BIG, (sc[hi] - new_hi).exp(), 0.0);
                    l_lo += sc[lo];
                    l_hi += sc[hi];
                }
            }
            let a_lo = Acc::new(alpha_lo);
            let a_hi = Acc::new(alpha_hi);
            #[unroll]
            for n in 0..n_tiles {
                acc[n * 2] = acc[n * 2] * a_lo;
                acc[n * 2 + 1] = acc[n * 2 + 1] * a_hi;
            }

            // 4. Weights x values: k-step kk (positions 16 kk..+16) takes n-tiles 2 kk
            //    (A registers 0, 1) and 2 kk + 1 (registers 2, 3) of the weights.
            #[unroll]
            for kk in 0..4usize {
                let mut pa = Array::<Frag>::new(4usize);
                #[unroll]
                for r in 0..4usize {
                    let at = ((2 * kk + r / 2) * 2 + r % 2) * 2;
                    let mut v = Frag::empty();
                    v[0] = bf16::cast_from(sc[at]);
                    v[1] = bf16::cast_from(sc[at + 1]);
                    pa[r] = v;
                }
                #[unroll]
                for np in 0..n_tiles / 2 {
                    let row = kk * 16 + ((lane / 8) % 2) * 8 + lane % 8;
                    let at = vb + row * v_stride + np * 2 + lane / 16;
                    let vf = mma.load_matrix::<Bf16x8, Const<2>>(
                        &vs.slice(at, at + 1),
                        cmma::MatrixIdent::B,
                        4usize,
                        true,
                    );
                    #[unroll]
                    for half in 0..2usize {
                        let n = np * 2 + half;
                        let mut bf = Array::<Frag>::new(2usize);
                        bf[0] = vf[half * 2];
                        bf[1] = vf[half * 2 + 1];
                        let mut cf = Array::<Acc>::new(2usize);
                        cf[0] = acc[n * 2];
                        cf[1] = acc[n * 2 + 1];
                        mma.execute_inplace(&pa, &bf, &mut cf);
                        acc[n * 2] = cf[0];
                        acc[n * 2 + 1] = cf[1];
                    }
                }
            }
            // Every unit done with this buffer before the copy two tiles on overwrites it.
            sync_cube();
        }

        l_lo += plane_shuffle_xor(l_lo, 1);
        l_lo += plane_shuffle_xor(l_lo, 2);
        l_hi += plane_shuffle_xor(l_hi, 1);
        l_hi += plane_shuffle_xor(l_hi, 2);
        #[unroll]
        for half in 0..2usize {
            if row_lo + half * 8 < rows_in_block {
                let l = select(half == 0, l_lo, l_hi);
                let at = at_lo + half * 8 * heads;
                let inv = Acc::new(1.0 / l);
                #[unroll]
                for n in 0..n_tiles {
                    let v = acc[n * 2 + half] * inv;
                    out[at * v_dim + n * 8 + 2 * t] = v[0];
                    out[at * v_dim + n * 8 + 2 * t + 1] = v[1];
                }
                if comptime!(resume.keep_state) && t == 0 {
                    lse[at] = select(half == 0, m_lo, m_hi) + l.ln();
                }
            }
        }
    }
}

/// The expanded context of a step in the tensor-core kernel's operand layout.
pub(super) struct Packed {
    keys: DeviceArray<u32>,
    values: DeviceArray<u32>,
    rows: usize,
}

/// Rounds `expanded` (`[rows, heads, nope + v]`) and `rope` (`[rows, 64]`) into the
/// head-major bf16 keys and values of [`attend`].
pub(super) fn pack<R: Runtime>(
    client: &ComputeClient<R>,
    expanded: &DeviceArray<f32>,
    rope: &DeviceArray<f32>,
    rows: usize,
    shape: KvBShape,
) -> Packed {
    let qk = shape.nope + ROPE;
    let packed = Packed {
        keys: DeviceArray::uninit(client, shape.heads * rows * qk / 2),
        values: DeviceArray::uninit(client, shape.heads * rows * shape.v / 2),
        rows,
    };
    // SAFETY: the caller checked the shapes (`mla_prefill_heads`); the arrays above hold
    // every (head, row) written.
    unsafe {
        pack_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows as u32, shape.heads as u32, 1),
            CubeDim::new_1d(PACK_UNITS),
            expanded.arg(),
            rope.arg(),
            packed.keys.arg(),
            packed.values.arg(),
            rows as u32,
            dims(shape),
        )
    }
    packed
}

/// Causal attention per head over [`pack`]ed keys and values of one chunk of the context
/// (rows `cu_rows`, from position `first_pos`): grid and arguments as the portable
/// kernel's (`q` `[tokens, heads, nope + 64]`, `out` `[tokens, heads, v]`, `lse` the
/// running state between chunks).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    packed: &Packed,
    meta: &super::AttnMetadata,
    cu_rows: &DeviceArray<u32>,
    first_pos: usize,
    resume: Resume,
    shape: KvBShape,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
    lse: &DeviceArray<f32>,
) {
    // SAFETY: as in `pack`; the metadata's device arrays are trusted.
    unsafe {
        attention_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(
                (meta.max_q_len as u32).div_ceil(ROWS),
                shape.heads as u32,
                meta.batch as u32,
            ),
            CubeDim::new_1d(UNITS),
            q.arg(),
            packed.keys.arg(),
            packed.values.arg(),
            meta.cu_q_lens.arg(),
            meta.kv_lens.arg(),
            cu_rows.arg(),
            out.arg(),
            lse.arg(),
            packed.rows as u32,
            first_pos as u32,
            softmax_scale,
            dims(shape),
            resume,
        )
    }
}

/// The CUDA C++ of the attention kernel for `shape`'s head dims, for a chunk that starts
/// from the state the chunk before left (`from_state`) and one that leaves its own
/// (`keep_state`), as CubeCL's CUDA runtime would compile it, generated on the host
/// ([`cuda_source`]): the conformance suite compiles it for Hopper and Blackwell targets.
pub fn attention_source(
    shape: KvBShape,
    from_state: bool,
    keep_state: bool,
) -> Result<String, KernelError> {
    let resume = Resume {
        from_state,
        keep_state,
    };
    cuda_source("attention_kernel", CubeDim::new_1d(UNITS), |b| {
        let q = input::<f32>(b);
        let (keys, values) = (input::<Bf16x8>(b), input::<Bf16x8>(b));
        let (cu_q_lens, kv_lens, cu_rows) = (input::<u32>(b), input::<u32>(b), input::<u32>(b));
        let (out, lse) = (output::<f32>(b), output::<f32>(b));
        let (rows, first_pos, scale) = (scalar::<u32>(b), scalar::<u32>(b), scalar::<f32>(b));
        attention_kernel::expand(
            &mut b.scope,
            q,
            keys,
            values,
            cu_q_lens,
            kv_lens,
            cu_rows,
            out,
            lse,
            rows,
            first_pos,
            scale,
            dims(shape),
            resume,
        );
    })
    .map(|kernel| kernel.text)
}

fn dims(shape: KvBShape) -> Dims {
    Dims {
        qk: (shape.nope + ROPE) as u32,
        v: shape.v as u32,
    }
}
