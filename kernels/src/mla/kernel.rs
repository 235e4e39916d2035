//! The cube kernel: a cube per (query tile, head, request), a unit per KV position of a chunk.
//!
//! Per chunk: each unit scores its KV row against every query of the tile (reading the row
//! once), the cube takes the chunk maximum per query, rescales its running sums (online
//! softmax), turns scores into weights, then each unit accumulates its own slice of the 512
//! output dimensions over the chunk's rows (coalesced across units).
use cubecl::prelude::*;

use super::tree_mask::{sees, tree_window};
use super::KvFormat;
use crate::formats::{bf16_to_f32, byte_at, e4m3_to_f32, half_at};

/// Compile-time shape of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaConfig {
    /// Query tokens per cube.
    pub tile: u32,
    /// Units per cube = KV positions per chunk.
    pub chunk: u32,
    pub format: KvFormat,
    /// Queries carry draft-tree masks (`tree_masks`, one word per query token).
    pub tree: bool,
}

/// Stands for minus infinity: WGSL has no infinite literals.
pub(super) const NEG_BIG: f32 = -3.0e38;
/// Iterations of the per-chunk loops written out per loop trip: few trips per chunk, as
/// some drivers cap the loop trips of a whole invocation (llvmpipe: 65,535 across all
/// loops, which at one trip per dimension ended a 16-head decode near 5,000 positions).
pub(super) const UNROLL: usize = 16;
// The chunk's maximum reads whole trips of UNROLL scores.
const _: () = assert!((super::CHUNK as usize).is_multiple_of(UNROLL));

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn mla_kernel(
    q: &Array<f32>,
    kv: &Array<u32>,
    block_table: &Array<u32>,
    cu_q_lens: &Array<u32>,
    kv_lens: &Array<u32>,
    tree_masks: &Array<u32>,
    out: &mut Array<f32>,
    heads: u32,
    max_blocks: u32,
    page_size: u32,
    softmax_scale: f32,
    #[comptime] cfg: MlaConfig,
) {
    let tile = cfg.tile as usize;
    let chunk = cfg.chunk as usize;
    let dims_per_unit = comptime!(512 / cfg.chunk as usize);
    let head = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let q_start = cu_q_lens[b] as usize;
    let q_len = cu_q_lens[b + 1] as usize - q_start;
    let kv_len = kv_lens[b] as usize;
    let first = CUBE_POS_X as usize * tile;

    if first < q_len {
        let rows_in_tile = min(tile, q_len - first);
        // Position of the tile's first query; query i sees positions 0..=pos0 + i.
        let pos0 = kv_len - q_len + first;
        let last_pos = pos0 + rows_in_tile - 1;
        let table = b * max_blocks as usize;

        let mut qs = SharedMemory::<f32>::new(comptime!(cfg.tile as usize * 576));
        let mut ps = SharedMemory::<f32>::new(comptime!(cfg.tile as usize * cfg.chunk as usize));
        for idx in range_stepped(unit, tile * 576, chunk) {
            let i = idx / 576;
            let mut value = 0.0f32;
            if i < rows_in_tile {
                value = q[((q_start + first + i) * heads as usize + head) * 576 + idx % 576];
            }
            qs[idx] = value;
        }

        let window = tree_window(kv_len, q_len);
        let mut masks = Array::<u32>::new(comptime!(cfg.tile as usize));
        #[unroll]
        for i in 0..tile {
            masks[i] = 0u32;
            if comptime!(cfg.tree) && i < rows_in_tile {
                masks[i] = tree_masks[q_start + first + i];
            }
        }

        let mut run_max = Array::<f32>::new(comptime!(cfg.tile as usize));
        let mut run_sum = Array::<f32>::new(comptime!(cfg.tile as usize));
        let mut acc = Array::<f32>::new(comptime!(cfg.tile as usize * 512 / cfg.chunk as usize));
        #[unroll]
        for i in 0..tile {
            run_max[i] = NEG_BIG;
            run_sum[i] = 0.0;
            #[unroll]
            for dd in 0..dims_per_unit {
                acc[i * dims_per_unit + dd] = 0.0;
            }
        }
        sync_cube();

        let chunks = last_pos / chunk + 1;
        for c in 0..chunks {
            let j = c * chunk + unit;
            // 1. Score this unit's row against every query of the tile.
            let mut scores = Array::<f32>::new(comptime!(cfg.tile as usize));
            #[unroll]
            for i in 0..tile {
                scores[i] = 0.0;
            }
            if j <= last_pos {
                let row = kv_row(block_table, table, j, page_size as usize);
                for d0 in 0..comptime!(576 / UNROLL) {
                    #[unroll]
                    for dk in 0..UNROLL {
                        let d = d0 * UNROLL + dk;
                        let k = kv_value(kv, row, d, cfg.format);
                        #[unroll]
                        for i in 0..tile {
                            scores[i] += qs[i * 576 + d] * k;
                        }
                    }
                }
            }
            #[unroll]
            for i in 0..tile {
                let visible = i < rows_in_tile && sees(j, pos0 + i, window, masks[i], cfg.tree);
                ps[i * chunk + unit] = select(visible, scores[i] * softmax_scale, NEG_BIG);
            }
            sync_cube();

            // 2-3. Chunk maximum per query, scores -> unnormalised weights.
            let mut scale_old = Array::<f32>::new(comptime!(cfg.tile as usize));
            chunk_weights(&mut ps, &mut run_max, &mut scale_old, unit, tile, chunk);

            // 4. Accumulate this unit's output dimensions over the chunk's rows.
            #[unroll]
            for i in 0..tile {
                run_sum[i] *= scale_old[i];
                #[unroll]
                for dd in 0..dims_per_unit {
                    acc[i * dims_per_unit + dd] *= scale_old[i];
                }
            }
            let rows_here = min(chunk, last_pos + 1 - c * chunk);
            for t0 in range_stepped(0, rows_here, UNROLL) {
                #[unroll]
                for tk in 0..UNROLL {
                    let t = t0 + tk;
                    if t < rows_here {
                        let row = kv_row(block_table, table, c * chunk + t, page_size as usize);
                        #[unroll]
                        for dd in 0..dims_per_unit {
                            let v = kv_value(kv, row, unit + dd * chunk, cfg.format);
                            #[unroll]
                            for i in 0..tile {
                                acc[i * dims_per_unit + dd] += ps[i * chunk + t] * v;
                            }
                        }
                        #[unroll]
                        for i in 0..tile {
                            run_sum[i] += ps[i * chunk + t];
                        }
                    }
                }
            }
            sync_cube();
        }

        #[unroll]
        for i in 0..tile {
            if i < rows_in_tile {
                let base = ((q_start + first + i) * heads as usize + head) * 512;
                #[unroll]
                for dd in 0..dims_per_unit {
                    out[base + unit + dd * chunk] = acc[i * dims_per_unit + dd] / run_sum[i];
                }
            }
        }
    }
}

/// Steps 2-3 of a KV chunk in the portable kernels (absorbed and per-head): each of the
/// `tile` queries' chunk maximum over its `chunk` scores in `ps` goes into `run_max` and
/// the factor its running sums are rescaled by into `scale_old` (every unit computes them,
/// from shared memory, in trips of [`UNROLL`]); then this unit's own score slot becomes
/// its unnormalised weight.
#[cube]
pub(super) fn chunk_weights(
    ps: &mut SharedMemory<f32>,
    run_max: &mut Array<f32>,
    scale_old: &mut Array<f32>,
    unit: usize,
    #[comptime] tile: usize,
    #[comptime] chunk: usize,
) {
    #[unroll]
    for i in 0..tile {
        let mut m = run_max[i];
        for t0 in range_stepped(0, chunk, UNROLL) {
            #[unroll]
            for tk in 0..UNROLL {
                m = max(m, ps[i * chunk + t0 + tk]);
            }
        }
        scale_old[i] = (run_max[i] - m).exp();
        run_max[i] = m;
    }
    sync_cube();
    #[unroll]
    for i in 0..tile {
        let s = ps[i * chunk + unit];
        ps[i * chunk + unit] = select(s > NEG_BIG, (s - run_max[i]).exp(), 0.0);
    }
    sync_cube();
}

/// Cache row holding position `pos` of the request whose block table starts at `table`.
#[cube]
pub(super) fn kv_row(
    block_table: &Array<u32>,
    table: usize,
    pos: usize,
    page_size: usize,
) -> usize {
    block_table[table + pos / page_size] as usize * page_size + pos % page_size
}

/// Element `d` (0..576) of cache row `row`, decoded from its storage format.
#[cube]
pub(super) fn kv_value(kv: &Array<u32>, row: usize, d: usize, #[comptime] format: KvFormat) -> f32 {
    if comptime!(format == KvFormat::F32) {
        f32::reinterpret(kv[row * 576 + d])
    } else if comptime!(format == KvFormat::Bf16) {
        bf16_to_f32(half_at(kv, row * 576 + d))
    } else {
        // 164 words per row: 128 of E4M3 codes, 4 f32 scales, 32 of bf16 rope pairs.
        let base = row * 164;
        if d < 512 {
            let scale = f32::reinterpret(kv[base + 128 + d / 128]);
            e4m3_to_f32(byte_at(kv, base * 4 + d)) * scale
        } else {
            bf16_to_f32(half_at(kv, (base + 132) * 2 + d - 512))
        }
    }
}
