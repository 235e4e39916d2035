//! MLA attention in the absorbed (MQA) form over a paged KV cache.
//!
//! Every head of a request attends to the same KV rows: 576 elements per token (512 latent,
//! which are also the values, + 64 rope). Queries arrive already absorbed (`q_nope x W_UK`
//! concatenated with the roped `q_pe`), `[tokens, heads, 576]`; outputs are the latent
//! `[tokens, heads, 512]` before `W_UV`. A batch is ragged: request `b` has `q_len` query
//! tokens at the end of its `kv_len` cached tokens, so query `i` sits at position
//! `kv_len - q_len + i` and sees positions `0..=` that one (causal), or, where the last
//! queries are a draft tree (`AttnMetadata::tree_masks`), the context before the tree and
//! its own ancestors (`tree_mask.rs`). Position `p` lives in page
//! `block_table[b][p / page_size]`, slot `p % page_size`.
//!
//! Two kernels. Where the device has bf16 `mma.sync` (CUDA) and the KV cache is bf16 or fp8,
//! both entry points run a tensor-core split-KV kernel (`mma.rs`: 16 query rows per cube,
//! each KV row read once for them, long contexts spread over the SMs, a combine pass; for
//! 64+ rows per request, `wide.rs`: 64 rows per cube, all heads of a Kimi token on one KV
//! read).
//! Elsewhere (wgpu, f32 KV) the portable kernel (`kernel.rs`) runs with two tilings:
//! [`mla_decode`] gives each query token its own cube, [`mla_prefill`] gives a cube a tile
//! of [`PREFILL_TILE`] consecutive query tokens of one request so each KV row read serves the
//! whole tile; both use an online softmax over chunks of [`CHUNK`] positions.
//! [`uses_tensor_cores`] says which one runs. The KV storage format (f32, bf16, or FlashMLA's
//! fp8 layout) is a compile-time parameter. Math oracle: `kiln_reference::mla::mla_attention`.
//! [`write_kv`] appends new tokens' rows to the cache in either format ([`write_kv_normed`]
//! straight from the `kv_a` projection, normalising and rotating on the way); [`absorb_query`]
//! and [`project_values`] are the per-head products around the attention; [`gather_pages`]
//! and [`scatter_pages`] move whole pages for the prefix cache's host tier.
mod absorb;
mod absorb_mma;
mod cache_write;
mod combine;
mod heads;
mod heads_mma;
mod kernel;
mod kv_chunks;
mod mma;
mod page_copy;
mod tree_mask;
mod wide;

use cubecl::prelude::*;

pub use absorb::{absorb_query, absorbs_on_tensor_cores, project_values, KvBShape};
pub use cache_write::{write_kv, write_kv_normed, KvRowPrep, PAD_SLOT};
pub use heads::{attends_per_head, mla_prefill_heads, ContextRows, PER_HEAD_MIN_Q_LEN};
pub use heads_mma::{attention_source as heads_attention_source, heads_on_tensor_cores};
pub use page_copy::{gather_pages, page_words, scatter_pages};
pub use tree_mask::{tree_mask_words, MAX_TREE_NODES};

use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError, Precision};

/// Elements of a key row: 512 latent + 64 rope.
pub const KV_DIM: usize = 576;
/// Elements of a value row (the latent part of the key row).
pub const V_DIM: usize = 512;
/// KV positions scored per chunk, one per unit of a cube.
pub const CHUNK: u32 = 64;
/// Query tokens per cube in [`mla_prefill`].
pub const PREFILL_TILE: u32 = 4;
/// Most query tokens per request that [`mla_decode`] takes (longer spans are prefill).
pub const MAX_DECODE_Q_LEN: usize = 64;

/// How one KV row is stored, as `u32` words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// 576 f32 values: exact, for conformance with unquantized peers and debugging.
    F32,
    /// 576 bf16 values, two per word (element `2i` in the low half).
    Bf16,
    /// FlashMLA's 656-byte row: 512 E4M3 latent codes, 4 f32 scales (one per 128 latent
    /// elements, `value = code * scale`), 64 bf16 rope values.
    Fp8,
}

impl KvFormat {
    /// Words per KV row.
    pub fn words_per_row(self) -> usize {
        match self {
            KvFormat::F32 => KV_DIM,
            KvFormat::Bf16 => KV_DIM / 2,
            KvFormat::Fp8 => 656 / 4,
        }
    }
}

/// A paged KV cache for one layer: `num_pages * page_size` rows.
pub struct PagedKvCache {
    pub data: DeviceArray<u32>,
    pub format: KvFormat,
    pub page_size: usize,
    pub num_pages: usize,
}

/// Where each request's queries and KV rows are. Device arrays are trusted by the kernel;
/// the host-side sizes are checked at launch.
pub struct AttnMetadata {
    /// Requests in the batch.
    pub batch: usize,
    /// Query tokens in the batch (`cu_q_lens[batch]`).
    pub num_tokens: usize,
    /// Largest `q_len` of the batch (sizes the grid).
    pub max_q_len: usize,
    /// Largest `kv_len` of the batch (sizes the split count of the tensor-core kernel).
    pub max_kv_len: usize,
    /// `batch + 1` prefix sums of the requests' query lengths.
    pub cu_q_lens: DeviceArray<u32>,
    /// `batch` KV lengths, each counting the request's own query tokens.
    pub kv_lens: DeviceArray<u32>,
    /// `[batch, max_blocks]` page ids.
    pub block_table: DeviceArray<u32>,
    pub max_blocks: usize,
    /// Draft-tree masks, one word per query token ([`tree_mask_words`]); `None`: causal.
    pub tree_masks: Option<DeviceArray<u32>>,
}

/// Attention for one or a few query tokens per request (decode, draft verification).
pub fn mla_decode<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    if meta.max_q_len > MAX_DECODE_Q_LEN {
        return Err(KernelError::Range {
            what: "query tokens per request (decode)",
            value: meta.max_q_len,
            min: 1,
            max: MAX_DECODE_Q_LEN,
        });
    }
    validate(client, q, heads, kv, meta, out)?;
    if uses_tensor_cores(client, kv.format, precision) {
        launch_mma(client, q, heads, kv, meta, softmax_scale, out);
    } else {
        launch_unchecked(client, q, heads, kv, meta, softmax_scale, out, 1);
    }
    Ok(())
}

/// Causal attention for long query spans over a cached prefix (prefill, extend).
pub fn mla_prefill<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    validate(client, q, heads, kv, meta, out)?;
    if uses_tensor_cores(client, kv.format, precision) {
        launch_mma(client, q, heads, kv, meta, softmax_scale, out);
    } else {
        launch_unchecked(client, q, heads, kv, meta, softmax_scale, out, PREFILL_TILE);
    }
    Ok(())
}

/// True when [`mla_decode`] and [`mla_prefill`] run the tensor-core kernel for this KV
/// format: bf16 or fp8 KV at `Bf16` precision on a device with bf16 `mma.sync m16n8k16`,
/// `ldmatrix` and plane shuffles. Its operands are rounded to bf16 (see `mma.rs`).
pub fn uses_tensor_cores<R: Runtime>(
    client: &ComputeClient<R>,
    format: KvFormat,
    precision: Precision,
) -> bool {
    precision == Precision::Bf16
        && format != KvFormat::F32
        && crate::tensor_cores::has_bf16_mma(client)
}

/// Split count of a tensor-core kernel: about `per_sm` cubes per SM without a partial
/// second wave, no split shorter than `min_chunks` chunks of the longest context.
fn mma_splits<R: Runtime>(
    client: &ComputeClient<R>,
    cubes: usize,
    per_sm: usize,
    min_chunks: usize,
    max_kv_len: usize,
) -> usize {
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(1) as usize;
    let chunks = max_kv_len.div_ceil(mma::CHUNK as usize).max(1);
    (per_sm * sms / cubes)
        .min(chunks.div_ceil(min_chunks))
        .clamp(1, combine::MAX_SPLITS)
}

/// True when a launch takes the 64-row kernel: at least 64 query rows in the longest
/// request (64 heads, or a few tokens of fewer), except one decode token over less than
/// 16k positions, where the 16-row kernel's 4 cubes per token start sooner (H200, 64 heads,
/// batch 1, bf16: 8k 30.5 against 37.9 us; 32k 60.6 against 55.7, session 3's 16-row run).
fn uses_wide(heads: usize, batch: usize, max_q_len: usize, max_kv_len: usize) -> bool {
    let short_single = batch == 1 && max_q_len == 1 && max_kv_len < 16384;
    heads * max_q_len >= wide::ROWS as usize && !short_single
}

/// How the tensor-core kernel launches for a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaShape {
    /// The 64-row kernel (else the 16-row one).
    pub wide: bool,
    /// Query-row groups of a request (the grid's x).
    pub groups: usize,
    /// KV splits (the grid's y; combined after when more than one).
    pub splits: usize,
}

fn mma_shape<R: Runtime>(
    client: &ComputeClient<R>,
    heads: usize,
    batch: usize,
    max_q_len: usize,
    max_kv_len: usize,
) -> MmaShape {
    let wide = uses_wide(heads, batch, max_q_len, max_kv_len);
    let (rows, per_sm, min_chunks) = if wide {
        (wide::ROWS, 1, 2)
    } else {
        (mma::ROWS, 2, 4)
    };
    let groups = (max_q_len * heads).div_ceil(rows as usize);
    let splits = mma_splits(client, groups * batch, per_sm, min_chunks, max_kv_len);
    MmaShape {
        wide,
        groups,
        splits,
    }
}

/// What [`mla_decode`]'s launches depend on beyond the arrays' lengths and the batch's
/// `batch`, `max_q_len`, `max_blocks` and page size: on tensor cores the kernel's shape
/// (its split count chosen by the longest context), `None` for the portable kernel. Work
/// replayed from a CUDA graph recorded at one `max_kv_len` is what a launch at another
/// computes when this agrees.
pub fn decode_launch<R: Runtime>(
    client: &ComputeClient<R>,
    heads: usize,
    format: KvFormat,
    precision: Precision,
    (batch, max_q_len, max_kv_len): (usize, usize, usize),
) -> Option<MmaShape> {
    (uses_tensor_cores(client, format, precision))
        .then(|| mma_shape(client, heads, batch, max_q_len, max_kv_len))
}

/// Launches the tensor-core kernel (and the combine when it splits the KV).
fn launch_mma<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
) {
    let MmaShape {
        wide,
        groups,
        splits,
    } = mma_shape(client, heads, meta.batch, meta.max_q_len, meta.max_kv_len);
    let total_rows = meta.num_tokens * heads;
    let (part_out, part_ml) = if splits > 1 {
        (
            DeviceArray::<f32>::uninit(client, splits * total_rows * V_DIM),
            DeviceArray::<f32>::uninit(client, splits * total_rows * 2),
        )
    } else {
        (
            DeviceArray::uninit(client, 1),
            DeviceArray::uninit(client, 1),
        )
    };
    let config = mma::MmaAttnConfig {
        format: kv.format,
        direct: splits == 1,
        tree: meta.tree_masks.is_some(),
    };
    let grid = CubeCount::Static(groups as u32, splits as u32, meta.batch as u32);
    let tree_masks = tree_masks_arg(meta);
    // Both kernels take the same arguments (the cache twice: as bf16 and as raw vectors).
    macro_rules! launch_attention {
        ($kernel:path, $units:expr) => {
            $kernel(
                client,
                grid,
                CubeDim::new_1d($units),
                q.arg(),
                kv.data.arg(),
                kv.data.arg(),
                meta.block_table.arg(),
                meta.cu_q_lens.arg(),
                meta.kv_lens.arg(),
                tree_masks.arg(),
                out.arg(),
                part_out.arg(),
                part_ml.arg(),
                heads as u32,
                meta.max_blocks as u32,
                kv.page_size as u32,
                total_rows as u32,
                softmax_scale,
                config,
            )
        };
    }
    // SAFETY: validated shapes; the partial buffers hold `splits` copies of every row.
    unsafe {
        if wide {
            launch_attention!(
                wide::wide_attention_kernel::launch_unchecked::<R>,
                wide::UNITS
            );
        } else {
            launch_attention!(mma::mma_attention_kernel::launch_unchecked::<R>, mma::UNITS);
        }
        if splits > 1 {
            let lanes = combine::combine_lanes(total_rows, splits);
            let dims = 4 * combine::COMBINE_UNITS / lanes;
            combine::combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(total_rows as u32, V_DIM as u32 / dims, 1),
                CubeDim::new_1d(combine::COMBINE_UNITS),
                part_out.arg(),
                part_ml.arg(),
                out.arg(),
                total_rows as u32,
                splits as u32,
                lanes,
            );
        }
    }
}

/// The kernels' mask argument: the masks, or (never read without a tree) `cu_q_lens`.
fn tree_masks_arg(meta: &AttnMetadata) -> &DeviceArray<u32> {
    meta.tree_masks.as_ref().unwrap_or(&meta.cu_q_lens)
}

fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    validate_batch(client, heads, kv, meta)?;
    check_index_space("query elements", meta.num_tokens * heads * KV_DIM)?;
    check_len("queries", q, meta.num_tokens * heads * KV_DIM)?;
    if let Some(masks) = &meta.tree_masks {
        check_len("tree masks", masks, meta.num_tokens)?;
    }
    check_len("output", out, meta.num_tokens * heads * V_DIM)
}

/// Checks a batch's metadata and cache against the grid both attention forms launch (a
/// cube row per query tile, head and request) and against each other.
fn validate_batch<R: Runtime>(
    client: &ComputeClient<R>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
) -> Result<(), KernelError> {
    let max = client.properties().hardware.max_cube_count;
    let ranges = [
        ("heads", heads, max.1 as usize),
        ("batch", meta.batch, max.2 as usize),
        ("page_size", kv.page_size, 1 << 16),
        ("max_q_len", meta.max_q_len, max.0 as usize),
        ("max_blocks", meta.max_blocks, u32::MAX as usize),
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
    let rows = kv.num_pages * kv.page_size;
    check_len(
        "KV cache (u32 words)",
        &kv.data,
        rows * kv.format.words_per_row(),
    )?;
    check_len("cu_q_lens", &meta.cu_q_lens, meta.batch + 1)?;
    check_len("kv_lens", &meta.kv_lens, meta.batch)?;
    check_len(
        "block_table",
        &meta.block_table,
        meta.batch * meta.max_blocks,
    )?;
    // The fp8 layout is addressed by byte.
    check_index_space("KV cache bytes", kv.data.len() * 4)
}

/// Launches without validation: trusts every buffer to match `heads` and `meta`, the
/// device metadata to be consistent (q_len <= kv_len, pages in range) and
/// `tile` query tokens per cube to cover `meta.max_q_len`.
#[allow(clippy::too_many_arguments)]
pub fn launch_unchecked<R: Runtime>(
    client: &ComputeClient<R>,
    q: &DeviceArray<f32>,
    heads: usize,
    kv: &PagedKvCache,
    meta: &AttnMetadata,
    softmax_scale: f32,
    out: &DeviceArray<f32>,
    tile: u32,
) {
    let tiles = (meta.max_q_len as u32).div_ceil(tile);
    let config = kernel::MlaConfig {
        tile,
        chunk: CHUNK,
        format: kv.format,
        tree: meta.tree_masks.is_some(),
    };
    // SAFETY: the caller guarantees buffers and metadata agree with the shapes.
    unsafe {
        kernel::mla_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tiles, heads as u32, meta.batch as u32),
            CubeDim::new_1d(CHUNK),
            q.arg(),
            kv.data.arg(),
            meta.block_table.arg(),
            meta.cu_q_lens.arg(),
            meta.kv_lens.arg(),
            tree_masks_arg(meta).arg(),
            out.arg(),
            heads as u32,
            meta.max_blocks as u32,
            kv.page_size as u32,
            softmax_scale,
            config,
        )
    }
}
