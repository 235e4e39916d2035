//! MLA prefill in the per-head (unabsorbed) form, as SGLang and vLLM run it (oracle:
//! `kiln_reference::mla_heads::mla_attention_heads`): each request's context rows are read
//! out of the paged cache (decoded from their format) into a latent and a rope buffer,
//! the latent is expanded by `kv_b_proj` into per-head keys and values (one GEMM over all
//! rows: `[rows, 512] x [512, heads * (nope + v)]`), then causal attention runs per head
//! over head dims `nope + 64` (keys) and `v` (values), its output the `[tokens, heads, v]`
//! that `o_proj` takes. Against the absorbed form's 576 + 512 products per head, query and
//! visible position it does `nope + 64 + v` (Kimi: 320), plus the expansion's
//! `512 * (nope + v)` per head and context row: it pays for a request whose new tokens
//! see many positions each (Kimi: from about 350 new tokens of a prefix, a causal half
//! visible on average), not for decode, whose one query would pay the expansion of the
//! whole context. Decode and draft trees stay absorbed.
//!
//! The attention kernel is the portable one's pattern (`kernel.rs`): a cube per (query
//! tile, head, request), a unit per position of a 64-position chunk, online softmax. Where
//! [`heads_on_tensor_cores`] holds (CUDA, bf16 or fp8 KV, `Bf16` precision), the expanded
//! keys and values are rounded to bf16 and attended by `heads_mma.rs`'s tensor-core
//! kernel instead. The engine routes requests of [`PER_HEAD_MIN_Q_LEN`] new tokens
//! or more here and the rest of the same step (decodes, short chunks) to the absorbed
//! kernels ([`attends_per_head`]; their queries gathered per form, their values scattered
//! back).
use cubecl::prelude::*;

use super::absorb::KvBShape;
use super::heads_mma::{self, heads_on_tensor_cores};
use super::kernel::{chunk_weights, kv_row, kv_value, NEG_BIG, UNROLL};
use super::{validate_batch, AttnMetadata, KvFormat, PagedKvCache, CHUNK, KV_DIM, V_DIM};
use crate::buffer::{check_index_space, check_len};
use crate::gemm::{bf16_gemm, Bf16Weights};
use crate::{DeviceArray, KernelError, Precision};

/// Width of the shared rope part of keys and queries.
const ROPE: usize = KV_DIM - V_DIM;
/// Context positions one cube of the read-out copies.
const ROWS_PER_CUBE: u32 = 16;
/// Query tokens per cube of the attention.
const TILE: u32 = 4;
/// Fewest new tokens of a request for which the engine attends in the per-head form by
/// default (`GpuModel::set_per_head_from`): above the break-even (see the module's notes,
/// about 350 for Kimi's dims), where the form saves most of the attention's products.
pub const PER_HEAD_MIN_Q_LEN: usize = 512;

/// Whether a request of `q_len` new tokens attends in the per-head form when requests of
/// `from` new tokens or more do (`None`: none do): a causal span that long (a draft tree
/// stays absorbed).
pub fn attends_per_head(q_len: usize, tree: bool, from: Option<usize>) -> bool {
    from.is_some_and(|from| q_len >= from.max(1)) && !tree
}

/// Each request's context rows, contiguous: request `b`'s from row `cu_kv_lens[b]`.
pub struct ContextRows {
    /// `batch + 1` prefix sums of the requests' KV lengths.
    pub cu_kv_lens: DeviceArray<u32>,
    /// Rows in all (`cu_kv_lens[batch]`).
    pub rows: usize,
}

impl ContextRows {
    /// The layout for requests of `kv_lens` context positions.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, kv_lens: &[usize]) -> Self {
        let mut cu = vec![0u32];
        for &l in kv_lens {
            cu.push(cu.last().expect("starts at 0") + l as u32);
        }
        ContextRows {
            rows: *cu.last().expect("starts at 0") as usize,
            cu_kv_lens: DeviceArray::upload(client, &cu),
        }
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn read_rows_kernel(
    kv: &Array<u32>,
    block_table: &Array<u32>,
    kv_lens: &Array<u32>,
    cu_kv_lens: &Array<u32>,
    latent: &mut Array<f32>,
    rope: &mut Array<f32>,
    max_blocks: u32,
    page_size: u32,
    #[comptime] format: KvFormat,
) {
    let b = CUBE_POS_Y as usize;
    let kv_len = kv_lens[b] as usize;
    let first = cu_kv_lens[b] as usize;
    let table = b * max_blocks as usize;
    for k in 0..ROWS_PER_CUBE as usize {
        let p = CUBE_POS_X as usize * ROWS_PER_CUBE as usize + k;
        if p < kv_len {
            let row = kv_row(block_table, table, p, page_size as usize);
            for d in range_stepped(UNIT_POS_X as usize, KV_DIM, CHUNK as usize) {
                let value = kv_value(kv, row, d, format);
                if d < V_DIM {
                    latent[(first + p) * V_DIM + d] = value;
                } else {
                    rope[(first + p) * ROPE + d - V_DIM] = value;
                }
            }
        }
    }
}

/// Compile-time shape of the attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct HeadsConfig {
    nope: u32,
    v: u32,
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn heads_kernel(
    q: &Array<f32>,
    expanded: &Array<f32>,
    rope: &Array<f32>,
    cu_q_lens: &Array<u32>,
    kv_lens: &Array<u32>,
    cu_kv_lens: &Array<u32>,
    out: &mut Array<f32>,
    heads: u32,
    softmax_scale: f32,
    #[comptime] cfg: HeadsConfig,
) {
    let tile = TILE as usize;
    let chunk = CHUNK as usize;
    let nope = cfg.nope as usize;
    let width = comptime!(cfg.nope as usize + ROPE);
    let kv_width = comptime!((cfg.nope + cfg.v) as usize);
    let dims_per_unit = comptime!((cfg.v as usize).div_ceil(CHUNK as usize));
    let heads = heads as usize;
    let head = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let q_start = cu_q_lens[b] as usize;
    let q_len = cu_q_lens[b + 1] as usize - q_start;
    let kv_len = kv_lens[b] as usize;
    let kv_first = cu_kv_lens[b] as usize;
    let first = CUBE_POS_X as usize * tile;

    if first < q_len {
        let rows_in_tile = min(tile, q_len - first);
        // Query i of the tile sees positions 0..=pos0 + i.
        let pos0 = kv_len - q_len + first;
        let last_pos = pos0 + rows_in_tile - 1;

        let mut qs =
            SharedMemory::<f32>::new(comptime!(TILE as usize * (cfg.nope as usize + ROPE)));
        let mut ps = SharedMemory::<f32>::new(comptime!((TILE * CHUNK) as usize));
        for idx in range_stepped(unit, tile * width, chunk) {
            let i = idx / width;
            let mut value = 0.0f32;
            if i < rows_in_tile {
                value = q[((q_start + first + i) * heads + head) * width + idx % width];
            }
            qs[idx] = value;
        }
        let mut run_max = Array::<f32>::new(TILE as usize);
        let mut run_sum = Array::<f32>::new(TILE as usize);
        let mut acc = Array::<f32>::new(comptime!(
            TILE as usize * (cfg.v as usize).div_ceil(CHUNK as usize)
        ));
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
            // 1. This unit's position against every query of the tile: nope dims from the
            //    head's expanded key, rope dims from the shared rope row.
            let mut scores = Array::<f32>::new(TILE as usize);
            #[unroll]
            for i in 0..tile {
                scores[i] = 0.0;
            }
            if j <= last_pos {
                let key = ((kv_first + j) * heads + head) * kv_width;
                #[unroll]
                for d in 0..nope {
                    let k = expanded[key + d];
                    #[unroll]
                    for i in 0..tile {
                        scores[i] += qs[i * width + d] * k;
                    }
                }
                #[unroll]
                for d in 0..ROPE {
                    let k = rope[(kv_first + j) * ROPE + d];
                    #[unroll]
                    for i in 0..tile {
                        scores[i] += qs[i * width + nope + d] * k;
                    }
                }
            }
            #[unroll]
            for i in 0..tile {
                let visible = i < rows_in_tile && j <= pos0 + i;
                ps[i * chunk + unit] = select(visible, scores[i] * softmax_scale, NEG_BIG);
            }
            sync_cube();

            // 2-3. Chunk maximum per query, scores -> unnormalised weights.
            let mut scale_old = Array::<f32>::new(TILE as usize);
            chunk_weights(&mut ps, &mut run_max, &mut scale_old, unit, tile, chunk);

            // 4. Each unit's value dimensions over the chunk's positions.
            #[unroll]
            for i in 0..tile {
                run_sum[i] *= scale_old[i];
                #[unroll]
                for dd in 0..dims_per_unit {
                    acc[i * dims_per_unit + dd] *= scale_old[i];
                }
            }
            // In trips of UNROLL positions: llvmpipe caps an invocation's loop trips.
            let rows_here = min(chunk, last_pos + 1 - c * chunk);
            for t0 in range_stepped(0, rows_here, UNROLL) {
                #[unroll]
                for tk in 0..UNROLL {
                    let t = t0 + tk;
                    if t < rows_here {
                        let value = ((kv_first + c * chunk + t) * heads + head) * kv_width + nope;
                        #[unroll]
                        for dd in 0..dims_per_unit {
                            let e = unit + dd * chunk;
                            if e < cfg.v as usize {
                                let v = expanded[value + e];
                                #[unroll]
                                for i in 0..tile {
                                    acc[i * dims_per_unit + dd] += ps[i * chunk + t] * v;
                                }
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
                let base = ((q_start + first + i) * heads + head) * cfg.v as usize;
                #[unroll]
                for dd in 0..dims_per_unit {
                    let e = unit + dd * chunk;
                    if e < cfg.v as usize {
                        out[base + e] = acc[i * dims_per_unit + dd] / run_sum[i];
                    }
                }
            }
        }
    }
}

/// Causal attention of long query spans in the per-head form: `q` `[tokens, heads, nope +
/// 64]` (rope part rotated) over the cached context of each request (`meta`, causal only:
/// no draft trees), `kv_b` `kv_b_proj` in bf16 words (`[heads * (nope + v), 512]`), `out`
/// `[tokens, heads, v]`. `context` lays out the requests' context rows (their KV lengths,
/// the same as `meta`'s). The expansion GEMM runs at `precision`.
#[allow(clippy::too_many_arguments)]
pub fn mla_prefill_heads<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    context: &ContextRows,
    kv_b: &DeviceArray<u32>,
    shape: KvBShape,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    validate_batch(client, shape.heads, kv, meta)?;
    let ranges = [
        ("nope (per-head keys)", shape.nope, 256),
        ("v (per-head values)", shape.v, 256),
        ("context rows", context.rows.max(1), u32::MAX as usize),
    ];
    for (what, value, max) in ranges {
        if value == 0 || value > max {
            return Err(KernelError::Range {
                what,
                value,
                min: 1,
                max,
            });
        }
    }
    if meta.tree_masks.is_some() {
        return Err(KernelError::Range {
            what: "draft trees (the per-head form is causal)",
            value: 1,
            min: 0,
            max: 0,
        });
    }
    let max_x = client.properties().hardware.max_cube_count.0;
    let rows_per_position = (meta.max_kv_len as u32).div_ceil(ROWS_PER_CUBE);
    if rows_per_position > max_x {
        return Err(KernelError::Range {
            what: "max_kv_len (per-head read-out)",
            value: meta.max_kv_len,
            min: 1,
            max: (max_x * ROWS_PER_CUBE) as usize,
        });
    }
    let (heads, kv_width) = (shape.heads, shape.nope + shape.v);
    check_len("cu_kv_lens", &context.cu_kv_lens, meta.batch + 1)?;
    check_len("queries", q, meta.num_tokens * heads * (shape.nope + ROPE))?;
    check_len("output", out, meta.num_tokens * heads * shape.v)?;
    check_index_space("expanded keys and values", context.rows * heads * kv_width)?;
    let tensor_cores = heads_on_tensor_cores(client, kv.format, precision, shape);
    if tensor_cores && context.rows > max_x as usize {
        return Err(KernelError::Range {
            what: "context rows (per-head pack)",
            value: context.rows,
            min: 1,
            max: max_x as usize,
        });
    }
    let latent = DeviceArray::<f32>::uninit(client, context.rows * V_DIM);
    let rope = DeviceArray::<f32>::uninit(client, context.rows * ROPE);
    // SAFETY: lengths checked above; the metadata's device arrays are trusted.
    unsafe {
        read_rows_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(rows_per_position, meta.batch as u32, 1),
            CubeDim::new_1d(CHUNK),
            kv.data.arg(),
            meta.block_table.arg(),
            meta.kv_lens.arg(),
            context.cu_kv_lens.arg(),
            latent.arg(),
            rope.arg(),
            meta.max_blocks as u32,
            kv.page_size as u32,
            kv.format,
        )
    }
    let weights = Bf16Weights {
        data: kv_b.clone(),
        experts: 1,
        n: heads * kv_width,
        k: V_DIM,
    };
    let expanded = DeviceArray::<f32>::uninit(client, context.rows * heads * kv_width);
    bf16_gemm(
        client,
        &latent,
        context.rows,
        &weights,
        &expanded,
        precision,
    )?;
    if tensor_cores {
        let packed = heads_mma::pack(client, &expanded, &rope, context.rows, shape);
        heads_mma::attend(
            client,
            q,
            &packed,
            meta,
            &context.cu_kv_lens,
            context.rows,
            shape,
            softmax_scale,
            out,
        );
        return Ok(());
    }
    let cfg = HeadsConfig {
        nope: shape.nope as u32,
        v: shape.v as u32,
    };
    // SAFETY: as above.
    unsafe {
        heads_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(
                (meta.max_q_len as u32).div_ceil(TILE),
                heads as u32,
                meta.batch as u32,
            ),
            CubeDim::new_1d(CHUNK),
            q.arg(),
            expanded.arg(),
            rope.arg(),
            meta.cu_q_lens.arg(),
            meta.kv_lens.arg(),
            context.cu_kv_lens.arg(),
            out.arg(),
            heads as u32,
            softmax_scale,
            cfg,
        )
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_causal_spans_attend_per_head_and_the_rest_absorbed() {
        let from = Some(PER_HEAD_MIN_Q_LEN);
        assert!(attends_per_head(PER_HEAD_MIN_Q_LEN, false, from));
        assert!(attends_per_head(100_000, false, from));
        assert!(!attends_per_head(PER_HEAD_MIN_Q_LEN - 1, false, from));
        assert!(!attends_per_head(1, false, from), "decode stays absorbed");
        assert!(
            !attends_per_head(5000, true, from),
            "draft trees stay absorbed"
        );
        assert!(!attends_per_head(5000, false, None), "off");
        assert!(
            attends_per_head(1, false, Some(0)),
            "from 0: every causal request"
        );
    }
}
