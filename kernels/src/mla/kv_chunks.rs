//! The KV side of both tensor-core attention kernels (`mma.rs`, `wide.rs`): a split's KV
//! chunks (32 positions) move into shared memory by cp.async ahead of their use, each
//! unit's rows looked up in the block table an iteration before their copy. bf16 rows go
//! straight into operand buffers: two chunk buffers one chunk ahead (64-row cube), or a
//! ring of half-chunk slots a chunk and a half ahead (16-row kernel). fp8 rows (FlashMLA's
//! 656 bytes: 512 E4M3 codes, 4 power-of-two f32 scales, 64 bf16 rope values) go one chunk
//! ahead to one staging buffer and are decoded exactly into the other operand buffer at
//! the end of the chunk before, after which an fp8 chunk is a bf16 one.
use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;
use half::bf16;

use super::kernel::kv_row;
use super::KvFormat;
use crate::warp_mma::Frag;

/// 16-byte vectors of bf16 per KV row (576 values).
pub(super) const ROW_VECS: usize = 72;
/// 16-byte vectors of an fp8 row (656 bytes).
pub(super) const FP8_ROW_VECS: usize = 41;
/// Shared-memory stride of a KV row in 16-byte vectors: odd, so the 8 rows an `ldmatrix`
/// reads fall in distinct bank groups.
pub(super) const KV_STRIDE: usize = 73;

/// A split's chunks `begin..end` of one request: its block table starts at `table`,
/// positions past `last_pos` read that one again (finite values, weighted 0), pages hold
/// `page_size` rows.
#[derive(CubeType)]
pub(super) struct KvSpan {
    pub begin: usize,
    pub end: usize,
    table: usize,
    last_pos: usize,
    page_size: usize,
}

#[cube]
impl KvSpan {
    pub fn new(begin: usize, end: usize, table: usize, last_pos: usize, page_size: usize) -> Self {
        KvSpan {
            begin,
            end,
            table,
            last_pos,
            page_size,
        }
    }

    /// The cache row this unit copies in chunk `c` (see [`copy_row`]): position
    /// `c * 32 + unit / (units / 32)`, or `last_pos` past it.
    pub fn row(
        &self,
        block_table: &Array<u32>,
        c: usize,
        unit: usize,
        #[comptime] units: usize,
    ) -> usize {
        let r = unit / comptime!(units / 32);
        kv_row(
            block_table,
            self.table,
            min(c * 32 + r, self.last_pos),
            self.page_size,
        )
    }

    /// The cache row this unit copies in half chunk `h` (positions `16 h..16 h + 16`; see
    /// [`copy_bf16_half`]): position `h * 16 + unit / (units / 16)`, or `last_pos` past it.
    pub fn half_row(
        &self,
        block_table: &Array<u32>,
        h: usize,
        unit: usize,
        #[comptime] units: usize,
    ) -> usize {
        let r = unit / comptime!(units / 16);
        kv_row(
            block_table,
            self.table,
            min(h * 16 + r, self.last_pos),
            self.page_size,
        )
    }
}

/// Half-chunk slots of the bf16 ring in the 16-row kernel: the chunk being read (2), the next
/// chunk and the first half of the one after in flight (3). Two halves of lead where a
/// double buffer has one chunk: 1.5x the bytes in flight per cube at 2 cubes per SM.
pub(super) const RING_SLOTS: usize = 5;

/// This unit's cache rows of the two half chunks it copies next into a ring.
#[derive(CubeType)]
pub(super) struct HalfRows {
    first: usize,
    second: usize,
}

#[cube]
impl HalfRows {
    /// Rows not looked up yet (the fp8 path keeps its own).
    pub fn new() -> Self {
        HalfRows {
            first: 0,
            second: 0,
        }
    }
}

/// Starts a split's bf16 ring: chunk `span.begin` (halves 0, 1: slots 0, 1) in flight on
/// `bar_a`, the first half of the next chunk (slot 2) on `bar_b`. Sets `rows` to the rows
/// of the next two halves (3 and 4) for [`next_bf16_halves`].
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn start_bf16_ring(
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    bar_a: &Barrier,
    bar_b: &Barrier,
    block_table: &Array<u32>,
    span: &KvSpan,
    rows: &mut HalfRows,
    unit: usize,
    #[comptime] units: usize,
) {
    let h0 = span.begin * 2;
    if span.begin < span.end {
        let first = span.half_row(block_table, h0, unit, units);
        let second = span.half_row(block_table, h0 + 1, unit, units);
        copy_bf16_half(kv_vecs, kvs, 0, first, unit, units);
        copy_bf16_half(kv_vecs, kvs, 1, second, unit, units);
        bar_a.commit_copy_async();
        if span.begin + 1 < span.end {
            let third = span.half_row(block_table, h0 + 2, unit, units);
            copy_bf16_half(kv_vecs, kvs, 2, third, unit, units);
            bar_b.commit_copy_async();
        }
    }
    rows.first = span.half_row(block_table, h0 + 3, unit, units);
    rows.second = span.half_row(block_table, h0 + 4, unit, units);
}

/// bf16 ring, at the top of chunk `c` (the split's `i`-th, `i = c - span.begin`; chunk `j`
/// of the split is on `bar_a` when `j` is even): starts the copy of the next chunk's second
/// half (half `2i + 3` of the split, in flight beside its first), waits for chunk `c` (slots
/// `2i % 5`, `(2i + 1) % 5`), then starts the first half of chunk `c + 2`. The slots written
/// held chunk `c - 1`, which every unit finished before chunk `c`. Moves `rows` on to the
/// next two halves.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn next_bf16_halves(
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    bar_a: &Barrier,
    bar_b: &Barrier,
    block_table: &Array<u32>,
    span: &KvSpan,
    c: usize,
    rows: &mut HalfRows,
    unit: usize,
    #[comptime] units: usize,
) {
    let i = c - span.begin;
    let even = i % 2 == 0;
    let h = i * 2;
    if c + 1 < span.end {
        copy_bf16_half(kv_vecs, kvs, (h + 3) % RING_SLOTS, rows.first, unit, units);
        if even {
            bar_b.commit_copy_async();
        } else {
            bar_a.commit_copy_async();
        }
    }
    if even {
        bar_a.arrive_and_wait();
    } else {
        bar_b.arrive_and_wait();
    }
    if c + 2 < span.end {
        copy_bf16_half(kv_vecs, kvs, (h + 4) % RING_SLOTS, rows.second, unit, units);
        if even {
            bar_a.commit_copy_async();
        } else {
            bar_b.commit_copy_async();
        }
    }
    let next = span.begin * 2 + h + 5;
    rows.first = span.half_row(block_table, next, unit, units);
    rows.second = span.half_row(block_table, next + 1, unit, units);
}

/// Starts a split's pipeline with `units` units: chunk `span.begin`'s rows in flight on
/// `bar` (bf16: into operand buffer 0; fp8: into staging, for [`next_fp8_chunk`] to decode
/// into buffer 0 once the kernel has loaded its queries). Returns this unit's cache row of
/// the next chunk to copy.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn start_chunks(
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
    kv_raw: &Array<Vector<u32, Const<4>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    staging: &mut SharedMemory<Vector<u32, Const<4>>>,
    bar: &Barrier,
    block_table: &Array<u32>,
    span: &KvSpan,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] format: KvFormat,
) -> usize {
    let mut row = span.row(block_table, span.begin, unit, units);
    if span.begin < span.end {
        if comptime!(format == KvFormat::Fp8) {
            copy_fp8_row(kv_raw, staging, row, unit, units);
        } else {
            copy_bf16_row(kv_vecs, kvs, 0, row, unit, units);
        }
        bar.commit_copy_async();
        row = span.row(block_table, span.begin + 1, unit, units);
    }
    row
}

/// fp8: when chunk `c` (before `span.end`) is in flight into staging on `bar`, waits for
/// it, decodes it into operand buffer `buf`, and once every unit is past (staging free, the
/// buffer complete), starts the copy of chunk `c + 1` from this unit's cache row `row`.
/// Returns the unit's cache row of chunk `c + 2`, or `row` when nothing was copied.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn next_fp8_chunk(
    kv_raw: &Array<Vector<u32, Const<4>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    staging: &mut SharedMemory<Vector<u32, Const<4>>>,
    bar: &Barrier,
    block_table: &Array<u32>,
    span: &KvSpan,
    c: usize,
    buf: usize,
    row: usize,
    unit: usize,
    #[comptime] units: usize,
) -> usize {
    let mut next = row;
    if c < span.end {
        bar.arrive_and_wait();
        decode_fp8_chunk(staging, kvs, buf, unit, units);
        sync_cube();
        if c + 1 < span.end {
            copy_fp8_row(kv_raw, staging, row, unit, units);
            bar.commit_copy_async();
            next = span.row(block_table, c + 2, unit, units);
        }
    }
    next
}

/// Starts this unit's cp.async copies of an fp8 chunk into `staging` ([`copy_row`]; rows of
/// 41 vectors, packed).
#[cube]
pub(super) fn copy_fp8_row(
    kv_raw: &Array<Vector<u32, Const<4>>>,
    staging: &mut SharedMemory<Vector<u32, Const<4>>>,
    cache_row: usize,
    unit: usize,
    #[comptime] units: usize,
) {
    let dst = (unit / comptime!(units / 32)) * FP8_ROW_VECS;
    copy_row(
        kv_raw,
        staging,
        cache_row,
        dst,
        unit,
        FP8_ROW_VECS,
        4u32,
        comptime!(units / 32),
    );
}

/// Starts this unit's cp.async copies of its share of one row: with `per_row` units to a
/// row, unit `u` copies every `per_row`-th of the `row_vecs` 16-byte vectors (`lanes`
/// elements each) of cache row `cache_row` into `dst[dst_row..]`, starting at `u % per_row`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn copy_row<V: CubePrimitive>(
    src: &Array<V>,
    dst: &mut SharedMemory<V>,
    cache_row: usize,
    dst_row: usize,
    unit: usize,
    #[comptime] row_vecs: usize,
    #[comptime] lanes: u32,
    #[comptime] per_row: usize,
) {
    let src_row = cache_row * row_vecs;
    let whole = comptime!(row_vecs.is_multiple_of(per_row));
    #[unroll]
    for j in 0..comptime!(row_vecs.div_ceil(per_row)) {
        let v = unit % per_row + j * per_row;
        if whole || v < row_vecs {
            copy_async(
                &src.slice(src_row + v, src_row + v + 1),
                &mut dst.slice_mut(dst_row + v, dst_row + v + 1),
                lanes,
            );
        }
    }
}

/// Starts this unit's cp.async copies of a bf16 chunk into operand buffer `buf` of `kvs`
/// ([`copy_row`]; rows of 72 vectors at a stride of [`KV_STRIDE`]).
#[cube]
pub(super) fn copy_bf16_row(
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    buf: usize,
    cache_row: usize,
    unit: usize,
    #[comptime] units: usize,
) {
    let dst = (buf * 32 + unit / comptime!(units / 32)) * KV_STRIDE;
    copy_row(
        kv_vecs,
        kvs,
        cache_row,
        dst,
        unit,
        ROW_VECS,
        8u32,
        comptime!(units / 32),
    );
}

/// Starts this unit's cp.async copies of its row of a half chunk (16 positions) into slot
/// `slot` of a ring of half-chunk buffers (rows at a stride of [`KV_STRIDE`]); its row is
/// `unit / (units / 16)` (see [`KvSpan::half_row`]).
#[cube]
fn copy_bf16_half(
    kv_vecs: &Array<Vector<bf16, Const<8>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    slot: usize,
    cache_row: usize,
    unit: usize,
    #[comptime] units: usize,
) {
    let dst = (slot * 16 + unit / comptime!(units / 16)) * KV_STRIDE;
    copy_row(
        kv_vecs,
        kvs,
        cache_row,
        dst,
        unit,
        ROW_VECS,
        8u32,
        comptime!(units / 16),
    );
}

/// Decodes the staging buffer (32 fp8 rows: 512 E4M3 codes, 4 f32 power-of-two scales, 64
/// bf16 rope values each) into operand buffer `buf` as the rows' values, exactly: each code
/// pair's bits move into bf16 as `code * 2^-120` (subnormal in bf16 where needed), then one
/// bf16x2 multiply by `2^120 * scale` gives `code * scale` (a second multiply where the
/// scale passes `2^7`, beyond bf16's range for the combined factor); dimensions land as
/// (0, 2, 1, 3) per 4. `units` is 128 or 256: unit `u` decodes scale group `(u / 32) % 4`
/// of row `u % 32` (half of it each when 256), so it reads one scale and a warp's 16-byte
/// reads and writes fall in distinct banks (row strides of 41 and 73 vectors).
#[cube]
pub(super) fn decode_fp8_chunk(
    staging: &SharedMemory<Vector<u32, Const<4>>>,
    kvs: &mut SharedMemory<Vector<bf16, Const<8>>>,
    buf: usize,
    unit: usize,
    #[comptime] units: usize,
) {
    let r = unit % 32;
    let grp = (unit / 32) % 4;
    let row = r * FP8_ROW_VECS;
    let dst = (buf * 32 + r) * KV_STRIDE;
    let scales = staging[row + 32];
    let scale = select(
        grp < 2,
        select(grp == 0, scales[0], scales[1]),
        select(grp == 2, scales[2], scales[3]),
    );
    // The scale's exponent field `e` (scale = 2^(e - 127)): `2^120 * scale` has field
    // `e + 120`, within bf16's range up to `e = 134`; past it, the rest as a second factor.
    let e = (scale >> 23) & 0xff;
    let first = Frag::reinterpret(((min(e, 134) + 120) << 7) * 0x0001_0001);
    let rest = Frag::reinterpret(((max(e, 134) - 7) << 7) * 0x0001_0001);
    let beyond = e > 134;
    let per_unit = comptime!(8 * 128 / units);
    #[unroll]
    for i in 0..per_unit {
        // Codes 16 cv..16 cv + 16 of the group: output vectors 2 cv, 2 cv + 1.
        let cv = (unit / 128) * per_unit + i;
        let codes = staging[row + grp * 8 + cv];
        #[unroll]
        for half in 0..2usize {
            let mut pairs = Vector::<u32, Const<4>>::empty();
            #[unroll]
            for h in 0..2usize {
                let w = codes[half * 2 + h];
                // Bytes 0 and 2, then 1 and 3, each into a bf16 half: magnitude bits to
                // 4..10, sign to 15.
                let p02 = ((w & 0x007f_007fu32) << 4) | ((w & 0x0080_0080u32) << 8);
                let p13 = ((w >> 4) & 0x07f0_07f0u32) | (w & 0x8000_8000u32);
                let mut x02 = Frag::reinterpret(p02) * first;
                let mut x13 = Frag::reinterpret(p13) * first;
                if beyond {
                    x02 *= rest;
                    x13 *= rest;
                }
                pairs[h * 2] = u32::reinterpret(x02);
                pairs[h * 2 + 1] = u32::reinterpret(x13);
            }
            kvs[dst + grp * 16 + 2 * cv + half] = Vector::<bf16, Const<8>>::reinterpret(pairs);
        }
    }
    // Rope: 8 bf16 vectors per row at staging vector 33, copied as they are.
    #[unroll]
    for j in 0..comptime!(256 / units) {
        let idx = unit + j * units;
        let rr = idx % 32;
        let v = idx / 32;
        kvs[(buf * 32 + rr) * KV_STRIDE + 64 + v] =
            Vector::<bf16, Const<8>>::reinterpret(staging[rr * FP8_ROW_VECS + 33 + v]);
    }
}
