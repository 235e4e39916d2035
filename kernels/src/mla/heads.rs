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

/// The per-head requests' context, read out and expanded a chunk of positions at a time:
/// chunk `k` holds positions `k * span..(k + 1) * span` of every request (those it has),
/// request after request. One chunk unless the rows pass the budget given to [`new`]; the
/// attention of each chunk resumes from the running softmax state the one before left
/// (its normalised output and log-sum-exp per query and head), so chunks bound the
/// expansion's memory without changing what is computed.
///
/// [`new`]: ContextRows::new
pub struct ContextRows {
    chunks: Vec<ContextChunk>,
}

/// One chunk of [`ContextRows`].
struct ContextChunk {
    /// Its first position.
    first_pos: usize,
    /// `batch + 1` prefix sums of the requests' rows in the chunk.
    cu_rows: DeviceArray<u32>,
    /// Rows in all.
    rows: usize,
    /// Most rows of one request.
    longest: usize,
}

impl ContextRows {
    /// The layout for requests of `kv_lens` context positions, in chunks of at most
    /// `max_rows` rows: the widest span of positions (a multiple of 64) whose rows fit, at
    /// least 64 (then a chunk may pass `max_rows` by up to 64 rows a request).
    pub fn new<R: Runtime>(client: &ComputeClient<R>, kv_lens: &[usize], max_rows: usize) -> Self {
        let longest = kv_lens.iter().copied().max().unwrap_or(0);
        let span = chunk_span(kv_lens, max_rows);
        let chunks = (0..longest.div_ceil(span).max(1))
            .map(|k| {
                let first_pos = k * span;
                let lens: Vec<usize> = kv_lens
                    .iter()
                    .map(|&l| l.saturating_sub(first_pos).min(span))
                    .collect();
                let mut cu = vec![0u32];
                for &n in &lens {
                    cu.push(cu.last().expect("starts at 0") + n as u32);
                }
                ContextChunk {
                    first_pos,
                    rows: lens.iter().sum(),
                    longest: lens.iter().copied().max().unwrap_or(0),
                    cu_rows: DeviceArray::upload(client, &cu),
                }
            })
            .collect();
        ContextRows { chunks }
    }

    /// Chunks the context is expanded in.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Rows of the largest chunk.
    pub fn max_rows(&self) -> usize {
        self.chunks.iter().map(|c| c.rows).max().unwrap_or(0)
    }
}

/// Positions per chunk for requests of `kv_lens` positions in chunks of at most `max_rows`
/// rows: the widest multiple of 64 whose rows fit (all of the longest context when they
/// do), at least 64.
fn chunk_span(kv_lens: &[usize], max_rows: usize) -> usize {
    let fits = |span: usize| kv_lens.iter().map(|&l| l.min(span)).sum::<usize>() <= max_rows;
    let whole = kv_lens
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .div_ceil(64)
        .max(1);
    if fits(whole * 64) {
        return whole * 64;
    }
    // `lo` fits (or is the least), `hi` does not.
    let (mut lo, mut hi) = (1, whole);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if fits(mid * 64) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * 64
}

/// Grid: (16-row groups of the chunk's longest request, batch); [`CHUNK`] units. Reads
/// request `b`'s rows of the chunk starting at position `first_pos` into `latent` and
/// `rope`, from row `cu_rows[b]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn read_rows_kernel(
    kv: &Array<u32>,
    block_table: &Array<u32>,
    cu_rows: &Array<u32>,
    latent: &mut Array<f32>,
    rope: &mut Array<f32>,
    first_pos: u32,
    max_blocks: u32,
    page_size: u32,
    #[comptime] format: KvFormat,
) {
    let b = CUBE_POS_Y as usize;
    let first = cu_rows[b] as usize;
    let len = cu_rows[b + 1] as usize - first;
    let table = b * max_blocks as usize;
    for k in 0..ROWS_PER_CUBE as usize {
        let p = CUBE_POS_X as usize * ROWS_PER_CUBE as usize + k;
        if p < len {
            let row = kv_row(
                block_table,
                table,
                first_pos as usize + p,
                page_size as usize,
            );
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

/// How a launch of the attention meets the running state of a chunked context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Resume {
    /// Not the first chunk: start from the state in `out` and `lse`.
    pub from_state: bool,
    /// Not the last chunk: leave each row's log-sum-exp in `lse` beside its output.
    pub keep_state: bool,
}

/// Compile-time shape of the attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct HeadsConfig {
    nope: u32,
    v: u32,
    resume: Resume,
}

/// Grid: (query tiles of the longest request, heads, batch); [`CHUNK`] units. Attends
/// positions `first_pos..` of the chunk whose rows `cu_rows` lays out.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn heads_kernel(
    q: &Array<f32>,
    expanded: &Array<f32>,
    rope: &Array<f32>,
    cu_q_lens: &Array<u32>,
    kv_lens: &Array<u32>,
    cu_rows: &Array<u32>,
    out: &mut Array<f32>,
    lse: &mut Array<f32>,
    heads: u32,
    first_pos: u32,
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
    let kv_first = cu_rows[b] as usize;
    let first_pos = first_pos as usize;
    let first = CUBE_POS_X as usize * tile;

    if first < q_len {
        let rows_in_tile = min(tile, q_len - first);
        // Query i of the tile sees positions 0..=pos0 + i; this chunk holds `first_pos..end`
        // of them.
        let pos0 = kv_len - q_len + first;
        let last_pos = pos0 + rows_in_tile - 1;
        let end = min(first_pos + cu_rows[b + 1] as usize - kv_first, last_pos + 1);

        if end > first_pos {
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
                // The chunks before left the normalised output: weight 1 at their max.
                if comptime!(cfg.resume.from_state) && i < rows_in_tile {
                    let row = (q_start + first + i) * heads + head;
                    run_max[i] = lse[row];
                    run_sum[i] = 1.0;
                    #[unroll]
                    for dd in 0..dims_per_unit {
                        let e = unit + dd * chunk;
                        if e < cfg.v as usize {
                            acc[i * dims_per_unit + dd] = out[row * cfg.v as usize + e];
                        }
                    }
                }
            }
            sync_cube();

            let chunks = (end - first_pos + chunk - 1) / chunk;
            for c in 0..chunks {
                let j = first_pos + c * chunk + unit;
                // 1. This unit's position against every query of the tile: nope dims from
                //    the head's expanded key, rope dims from the shared rope row.
                let mut scores = Array::<f32>::new(TILE as usize);
                #[unroll]
                for i in 0..tile {
                    scores[i] = 0.0;
                }
                if j < end {
                    let row = kv_first + j - first_pos;
                    let key = (row * heads + head) * kv_width;
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
                        let k = rope[row * ROPE + d];
                        #[unroll]
                        for i in 0..tile {
                            scores[i] += qs[i * width + nope + d] * k;
                        }
                    }
                }
                #[unroll]
                for i in 0..tile {
                    let visible = i < rows_in_tile && j < end && j <= pos0 + i;
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
                let rows_here = min(chunk, end - first_pos - c * chunk);
                for t0 in range_stepped(0, rows_here, UNROLL) {
                    #[unroll]
                    for tk in 0..UNROLL {
                        let t = t0 + tk;
                        if t < rows_here {
                            let value =
                                ((kv_first + c * chunk + t) * heads + head) * kv_width + nope;
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
                    let row = (q_start + first + i) * heads + head;
                    #[unroll]
                    for dd in 0..dims_per_unit {
                        let e = unit + dd * chunk;
                        if e < cfg.v as usize {
                            out[row * cfg.v as usize + e] =
                                acc[i * dims_per_unit + dd] / run_sum[i];
                        }
                    }
                    if comptime!(cfg.resume.keep_state) && unit == 0 {
                        lse[row] = run_max[i] + run_sum[i].ln();
                    }
                }
            }
        }
    }
}

/// Causal attention of long query spans in the per-head form: `q` `[tokens, heads, nope +
/// 64]` (rope part rotated) over the cached context of each request (`meta`, causal only:
/// no draft trees), `kv_b` `kv_b_proj` in bf16 words (`[heads * (nope + v), 512]`), `out`
/// `[tokens, heads, v]`. `context` lays out the requests' context rows in chunks (built
/// from the same KV lengths as `meta`); each chunk's rows are read out, expanded (the GEMM
/// at `precision`) and attended in turn.
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
    let max_rows = context.max_rows();
    let ranges = [
        ("nope (per-head keys)", shape.nope, 256),
        ("v (per-head values)", shape.v, 256),
        ("context rows of a chunk", max_rows, u32::MAX as usize),
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
    let (heads, kv_width) = (shape.heads, shape.nope + shape.v);
    let tensor_cores = heads_on_tensor_cores(client, kv.format, precision, shape);
    let max_x = client.properties().hardware.max_cube_count.0 as usize;
    // The read-out's grid (16 rows a cube), and the pack's (a row a cube).
    let (grid_x, per_cube) = if tensor_cores {
        (max_rows, 1)
    } else {
        (
            max_rows.div_ceil(ROWS_PER_CUBE as usize),
            ROWS_PER_CUBE as usize,
        )
    };
    if grid_x > max_x {
        return Err(KernelError::Range {
            what: "context rows of a chunk (per-head read-out)",
            value: max_rows,
            min: 1,
            max: max_x * per_cube,
        });
    }
    for chunk in &context.chunks {
        check_len("chunk row offsets", &chunk.cu_rows, meta.batch + 1)?;
    }
    check_len("queries", q, meta.num_tokens * heads * (shape.nope + ROPE))?;
    check_len("output", out, meta.num_tokens * heads * shape.v)?;
    check_index_space("expanded keys and values", max_rows * heads * kv_width)?;
    let weights = Bf16Weights {
        data: kv_b.clone(),
        experts: 1,
        n: heads * kv_width,
        k: V_DIM,
    };
    let chunks = context.chunks.len();
    // Each query and head's log-sum-exp between chunks.
    let lse = DeviceArray::<f32>::uninit(
        client,
        if chunks > 1 {
            meta.num_tokens * heads
        } else {
            1
        },
    );
    for (k, chunk) in context.chunks.iter().enumerate() {
        let resume = Resume {
            from_state: k > 0,
            keep_state: k + 1 < chunks,
        };
        let latent = DeviceArray::<f32>::uninit(client, chunk.rows * V_DIM);
        let rope = DeviceArray::<f32>::uninit(client, chunk.rows * ROPE);
        // SAFETY: lengths checked above; the metadata's device arrays are trusted.
        unsafe {
            read_rows_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(
                    (chunk.longest as u32).div_ceil(ROWS_PER_CUBE),
                    meta.batch as u32,
                    1,
                ),
                CubeDim::new_1d(CHUNK),
                kv.data.arg(),
                meta.block_table.arg(),
                chunk.cu_rows.arg(),
                latent.arg(),
                rope.arg(),
                chunk.first_pos as u32,
                meta.max_blocks as u32,
                kv.page_size as u32,
                kv.format,
            )
        }
        let expanded = DeviceArray::<f32>::uninit(client, chunk.rows * heads * kv_width);
        bf16_gemm(client, &latent, chunk.rows, &weights, &expanded, precision)?;
        if tensor_cores {
            let packed = heads_mma::pack(client, &expanded, &rope, chunk.rows, shape);
            heads_mma::attend(
                client,
                q,
                &packed,
                meta,
                &chunk.cu_rows,
                chunk.first_pos,
                resume,
                shape,
                softmax_scale,
                out,
                &lse,
            );
            continue;
        }
        let cfg = HeadsConfig {
            nope: shape.nope as u32,
            v: shape.v as u32,
            resume,
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
                chunk.cu_rows.arg(),
                out.arg(),
                lse.arg(),
                heads as u32,
                chunk.first_pos as u32,
                softmax_scale,
                cfg,
            )
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_the_widest_span_of_positions_whose_rows_fit() {
        assert_eq!(chunk_span(&[100, 1000], usize::MAX), 1024, "whole");
        assert_eq!(chunk_span(&[100, 1000], 1100), 1024, "exactly whole");
        // 100 + 384 = 484 rows fit 500; 100 + 448 = 548 do not.
        assert_eq!(chunk_span(&[100, 1000], 500), 384);
        assert_eq!(chunk_span(&[1000, 1000], 64), 64, "at least 64 positions");
        assert_eq!(chunk_span(&[], 10), 64);
    }

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
