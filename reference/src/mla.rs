//! Multi-head latent attention in its absorbed (MQA) form over a paged KV cache, and
//! FlashMLA's FP8 KV row layout. Computed in f64.
//!
//! With `W_UK` absorbed into q and `W_UV` into the output projection, every head of a
//! request attends over the same cached rows of 576 values: 512 latent (`c_kv`, also
//! the value) followed by 64 rope dims (`k_pe`). For query `t`, head `h`:
//! `s_j = softmax_scale * q[t, h, :576] · row_j[:576]`, `out[t, h] = sum_j softmax(s)_j
//! row_j[:512]`.
//!
//! Invariants of a batch: query `i` (0-based within its request's `q_len` tokens) of
//! request `b` sits at position `kv_lens[b] - q_lens[b] + i` and sees kv positions
//! `0..=` that position (causal; with `q_len == 1` that is the whole context, decode).
//! A request may end in a draft tree (speculative decoding): its last `parents.len()`
//! queries are the tree's nodes, node `k` at position `start + k` with `start = kv_len -
//! parents.len()`, and node `k` sees the positions before `start` and its own ancestors
//! (itself included, [`crate::tree::tree_mask`]) instead of everything up to itself.
//! Position `p` lives in row `block_tables[b][p / page_size] * page_size + p % page_size`.
//!
//! Follows DeepSeek-V3's `inference/model.py` (`attn_impl = "absorb"`) and FlashMLA's
//! paged interface (block tables, page-major cache) and FP8 KV format (656 bytes per
//! token: 512 e4m3 in four 128-wide tiles, four f32 power-of-two tile scales, 64 bf16 rope
//! values).

use crate::formats::{bf16_decode, bf16_encode, bf16_round, e4m3_decode, e4m3_encode, E4M3_MAX};
use crate::softmax::softmax_row;
use std::fmt;

/// Latent (value) width of a KV row.
pub const KV_LORA_RANK: usize = 512;
/// Rope width of a KV row.
pub const QK_ROPE_DIM: usize = 64;
/// Values per KV row (and per absorbed query head).
pub const KV_DIM: usize = KV_LORA_RANK + QK_ROPE_DIM;
/// Bytes per row in FlashMLA's FP8 layout.
pub const FP8_KV_BYTES: usize = KV_LORA_RANK + 4 * 4 + QK_ROPE_DIM * 2;

/// Width of one FP8 scale tile of the latent part.
const FP8_TILE: usize = 128;

/// A batch that does not fit its cache.
#[derive(Debug, Clone, PartialEq)]
pub enum MlaError {
    /// `q_lens`, `kv_lens` and `block_tables` have different lengths.
    RequestCountMismatch {
        q_lens: usize,
        kv_lens: usize,
        block_tables: usize,
    },
    /// A request has no query tokens.
    EmptyQuery { request: usize },
    /// A request has more query tokens than context.
    QueryLongerThanContext {
        request: usize,
        q_len: usize,
        kv_len: usize,
    },
    /// A block table has fewer pages than the context needs.
    BlockTableTooShort {
        request: usize,
        pages: usize,
        needed: usize,
    },
    /// A block table names a page beyond the cache.
    PageOutOfRange {
        request: usize,
        page: u32,
        num_pages: usize,
    },
    /// The cache's row buffer does not hold `num_pages * page_size` rows.
    CacheSizeMismatch { expected: usize, got: usize },
    /// `trees` is neither empty nor one entry per request.
    TreeCountMismatch { trees: usize, requests: usize },
    /// A request's draft tree is malformed or longer than its queries.
    BadTree { request: usize, reason: String },
}

impl fmt::Display for MlaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RequestCountMismatch {
                q_lens,
                kv_lens,
                block_tables,
            } => write!(
                f,
                "{q_lens} q_lens, {kv_lens} kv_lens and {block_tables} block tables"
            ),
            Self::EmptyQuery { request } => write!(f, "request {request} has q_len 0"),
            Self::QueryLongerThanContext {
                request,
                q_len,
                kv_len,
            } => {
                write!(f, "request {request}: q_len {q_len} > kv_len {kv_len}")
            }
            Self::BlockTableTooShort {
                request,
                pages,
                needed,
            } => {
                write!(
                    f,
                    "request {request}: block table has {pages} pages, needs {needed}"
                )
            }
            Self::PageOutOfRange {
                request,
                page,
                num_pages,
            } => {
                write!(
                    f,
                    "request {request}: page {page} out of range (num_pages {num_pages})"
                )
            }
            Self::CacheSizeMismatch { expected, got } => {
                write!(f, "cache holds {got} values, expected {expected}")
            }
            Self::TreeCountMismatch { trees, requests } => {
                write!(f, "{trees} draft trees for {requests} requests")
            }
            Self::BadTree { request, reason } => {
                write!(f, "request {request}: draft tree {reason}")
            }
        }
    }
}

impl std::error::Error for MlaError {}

/// A paged KV cache as the attention kernel sees it (after decoding any storage
/// format): `num_pages * page_size` rows of [`KV_DIM`] values, row `page * page_size +
/// slot`.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedKv {
    /// Rows per page.
    pub page_size: usize,
    /// Pages in the cache.
    pub num_pages: usize,
    /// `[num_pages * page_size, KV_DIM]` row values.
    pub rows: Vec<f32>,
}

impl PagedKv {
    /// The `KV_DIM` values of cache row `index`.
    pub fn row(&self, index: usize) -> &[f32] {
        &self.rows[index * KV_DIM..(index + 1) * KV_DIM]
    }

    /// The same cache with every row passed through FlashMLA's FP8 encode + decode.
    pub fn fp8_round(&self) -> Self {
        let rows = self
            .rows
            .chunks(KV_DIM)
            .flat_map(|r| fp8_row_decode(&fp8_row_encode(r)));
        Self {
            rows: rows.collect(),
            ..self.clone()
        }
    }

    /// The same cache with every value rounded to bf16.
    pub fn bf16_round(&self) -> Self {
        Self {
            rows: bf16_row_round(&self.rows),
            ..self.clone()
        }
    }
}

/// Per-request shape of an attention batch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AttnBatch {
    /// New (query) tokens per request; their queries are laid out request after request.
    pub q_lens: Vec<usize>,
    /// Context length per request, the query tokens included.
    pub kv_lens: Vec<usize>,
    /// Page ids per request, in position order.
    pub block_tables: Vec<Vec<u32>>,
    /// Per request, the parents of a draft tree over its last queries (`None`: causal);
    /// empty: every request causal.
    pub trees: Vec<Option<Vec<i32>>>,
}

impl AttnBatch {
    /// Total query tokens, `sum(q_lens)`.
    pub fn num_tokens(&self) -> usize {
        self.q_lens.iter().sum()
    }

    /// Checks the batch against the cache: `1 <= q_len <= kv_len`, block tables cover
    /// `ceil(kv_len / page_size)` pages, all of them `< num_pages`.
    pub fn validate(&self, kv: &PagedKv) -> Result<(), MlaError> {
        let expected = kv.num_pages * kv.page_size * KV_DIM;
        if kv.rows.len() != expected {
            return Err(MlaError::CacheSizeMismatch {
                expected,
                got: kv.rows.len(),
            });
        }
        let n = self.q_lens.len();
        if !(self.trees.is_empty() || self.trees.len() == n) {
            return Err(MlaError::TreeCountMismatch {
                trees: self.trees.len(),
                requests: n,
            });
        }
        if self.kv_lens.len() != n || self.block_tables.len() != n {
            return Err(MlaError::RequestCountMismatch {
                q_lens: n,
                kv_lens: self.kv_lens.len(),
                block_tables: self.block_tables.len(),
            });
        }
        for (request, ((&q_len, &kv_len), table)) in self
            .q_lens
            .iter()
            .zip(&self.kv_lens)
            .zip(&self.block_tables)
            .enumerate()
        {
            if q_len == 0 {
                return Err(MlaError::EmptyQuery { request });
            }
            if q_len > kv_len {
                return Err(MlaError::QueryLongerThanContext {
                    request,
                    q_len,
                    kv_len,
                });
            }
            let needed = kv_len.div_ceil(kv.page_size);
            if table.len() < needed {
                return Err(MlaError::BlockTableTooShort {
                    request,
                    pages: table.len(),
                    needed,
                });
            }
            if let Some(Some(parents)) = self.trees.get(request) {
                let tree = crate::tree::Tree {
                    parents: parents.clone(),
                    tokens: vec![0; parents.len()],
                };
                let reason = match tree.validate() {
                    Err(e) => Some(e.to_string()),
                    Ok(()) if parents.len() > q_len => {
                        Some(format!("has {} nodes for {q_len} queries", parents.len()))
                    }
                    Ok(()) => None,
                };
                if let Some(reason) = reason {
                    return Err(MlaError::BadTree { request, reason });
                }
            }
            if let Some(&page) = table[..needed]
                .iter()
                .find(|&&p| p as usize >= kv.num_pages)
            {
                return Err(MlaError::PageOutOfRange {
                    request,
                    page,
                    num_pages: kv.num_pages,
                });
            }
        }
        Ok(())
    }

    /// Positions that query `i` of request `b` attends to, in order.
    pub fn visible_positions(&self, b: usize, i: usize) -> Vec<usize> {
        let (q_len, kv_len) = (self.q_lens[b], self.kv_lens[b]);
        let pos = kv_len - q_len + i;
        match self.trees.get(b) {
            Some(Some(parents)) if q_len - i <= parents.len() => {
                let n = parents.len();
                let start = kv_len - n;
                let node = pos - start;
                let mask = crate::tree::tree_mask(parents);
                (0..start)
                    .chain((0..n).filter(|&j| mask[node * n + j]).map(|j| start + j))
                    .collect()
            }
            _ => (0..=pos).collect(),
        }
    }

    /// Cache row of position `p` of request `b`.
    pub fn row_of(&self, b: usize, p: usize, page_size: usize) -> usize {
        self.block_tables[b][p / page_size] as usize * page_size + p % page_size
    }
}

/// Attention result with the magnitudes its tolerance is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnOutput {
    /// `[T, H, KV_LORA_RANK]` attention output.
    pub out: Vec<f64>,
    /// Per `(t, h)`: max `|v|` over the visible rows' latent values.
    pub value_magnitude: Vec<f64>,
    /// Per `(t, h)`: `softmax_scale * max_j sum_d |q_d k_jd|` over visible rows `j`.
    pub score_magnitude: Vec<f64>,
}

/// Absorbed MLA attention: `q` is `[T, heads, KV_DIM]` with `T = batch.num_tokens()`,
/// tokens in request order. Scores use all 576 dims, values the first 512.
///
/// Panics if the batch does not validate against `kv` or `q` has the wrong length.
pub fn mla_attention(
    q: &[f32],
    heads: usize,
    kv: &PagedKv,
    batch: &AttnBatch,
    softmax_scale: f32,
) -> AttnOutput {
    if let Err(e) = batch.validate(kv) {
        panic!("invalid attention batch: {e}");
    }
    let tokens = batch.num_tokens();
    assert_eq!(
        q.len(),
        tokens * heads * KV_DIM,
        "q is not [{tokens}, {heads}, {KV_DIM}]"
    );
    let mut res = AttnOutput {
        out: Vec::with_capacity(tokens * heads * KV_LORA_RANK),
        value_magnitude: Vec::with_capacity(tokens * heads),
        score_magnitude: Vec::with_capacity(tokens * heads),
    };
    let mut t = 0;
    for (b, &q_len) in batch.q_lens.iter().enumerate() {
        for i in 0..q_len {
            let visible: Vec<&[f32]> = batch
                .visible_positions(b, i)
                .into_iter()
                .map(|p| kv.row(batch.row_of(b, p, kv.page_size)))
                .collect();
            let value_mag = visible
                .iter()
                .flat_map(|r| &r[..KV_LORA_RANK])
                .fold(0.0f64, |m, &v| m.max((v as f64).abs()));
            for h in 0..heads {
                let qh = &q[(t * heads + h) * KV_DIM..(t * heads + h + 1) * KV_DIM];
                attend_one(qh, &visible, softmax_scale as f64, &mut res);
                res.value_magnitude.push(value_mag);
            }
            t += 1;
        }
    }
    res
}

/// One (token, head): appends the output row and the score magnitude.
fn attend_one(q: &[f32], rows: &[&[f32]], scale: f64, res: &mut AttnOutput) {
    let dot = |r: &[f32], f: fn(f64) -> f64| -> f64 {
        q.iter().zip(r).map(|(&a, &b)| f(a as f64 * b as f64)).sum()
    };
    let scores = rows.iter().map(|r| scale * dot(r, |x| x));
    let probs = softmax_row(scores);
    let mag = rows
        .iter()
        .map(|r| scale * dot(r, f64::abs))
        .fold(0.0, f64::max);
    res.score_magnitude.push(mag);
    let mut acc = vec![0.0f64; KV_LORA_RANK];
    for (p, r) in probs.iter().zip(rows) {
        for (a, &v) in acc.iter_mut().zip(&r[..KV_LORA_RANK]) {
            *a += p * v as f64;
        }
    }
    res.out.extend(acc);
}

/// The scale of a 128-wide latent tile whose largest magnitude is `amax`: the smallest
/// power of two `s` (at least `2^-126`, the smallest normal f32) with `amax / s <= 448`,
/// and 1.0 for an all-zero tile. FlashMLA's KV packing takes the same power-of-two
/// (UE8M0) scales; with them `x / s` and `code * s` are exact, in f32 and in bf16.
pub fn fp8_tile_scale(amax: f32) -> f32 {
    if amax == 0.0 {
        return 1.0;
    }
    let fits = |k: i32| amax as f64 <= E4M3_MAX as f64 * 2f64.powi(k);
    let mut k = (amax as f64 / E4M3_MAX as f64).log2().ceil() as i32;
    while !fits(k) {
        k += 1;
    }
    while k > -126 && fits(k - 1) {
        k -= 1;
    }
    2f64.powi(k.max(-126)) as f32
}

/// Encodes one 576-value row in FlashMLA's 656-byte FP8 layout: bytes `0..512` are
/// e4m3 codes of `latent / scale_t` per 128-wide tile `t` with `scale_t` from
/// [`fp8_tile_scale`], bytes `512..528` the four f32 scales little-endian, bytes
/// `528..656` the 64 rope values as little-endian bf16.
///
/// Panics if `row.len() != KV_DIM`.
pub fn fp8_row_encode(row: &[f32]) -> [u8; FP8_KV_BYTES] {
    assert_eq!(row.len(), KV_DIM, "a KV row has {KV_DIM} values");
    let mut out = [0u8; FP8_KV_BYTES];
    for (t, tile) in row[..KV_LORA_RANK].chunks(FP8_TILE).enumerate() {
        let amax = tile.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = fp8_tile_scale(amax);
        for (j, &v) in tile.iter().enumerate() {
            out[t * FP8_TILE + j] = e4m3_encode(v / scale);
        }
        let at = KV_LORA_RANK + 4 * t;
        out[at..at + 4].copy_from_slice(&scale.to_le_bytes());
    }
    for (j, &v) in row[KV_LORA_RANK..].iter().enumerate() {
        let at = KV_LORA_RANK + 16 + 2 * j;
        out[at..at + 2].copy_from_slice(&bf16_encode(v).to_le_bytes());
    }
    out
}

/// Decodes a 656-byte FP8 row: latent `e4m3_decode(code) * scale_t` in f32, rope from
/// bf16.
///
/// Panics if `bytes.len() != FP8_KV_BYTES`.
pub fn fp8_row_decode(bytes: &[u8]) -> [f32; KV_DIM] {
    assert_eq!(
        bytes.len(),
        FP8_KV_BYTES,
        "an FP8 KV row has {FP8_KV_BYTES} bytes"
    );
    let mut row = [0.0f32; KV_DIM];
    for (i, v) in row[..KV_LORA_RANK].iter_mut().enumerate() {
        let at = KV_LORA_RANK + 4 * (i / FP8_TILE);
        let scale = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        *v = e4m3_decode(bytes[i]) * scale;
    }
    for (j, v) in row[KV_LORA_RANK..].iter_mut().enumerate() {
        let at = KV_LORA_RANK + 16 + 2 * j;
        *v = bf16_decode(u16::from_le_bytes([bytes[at], bytes[at + 1]]));
    }
    row
}

/// Rounds every value of `row` to bf16 (the bf16 KV cache's view of a row).
pub fn bf16_row_round(row: &[f32]) -> Vec<f32> {
    row.iter().map(|&v| bf16_round(v)).collect()
}

#[cfg(test)]
#[path = "mla_tests.rs"]
mod tests;
