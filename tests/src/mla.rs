//! MLA attention cases (decode and prefill/extend, bf16 and fp8 KV) against
//! `kiln_reference::mla::mla_attention`.
//!
//! The cache is filled with random rows stored in the case's format; the reference attends
//! over the decoded rows (the exact values the kernel decodes), so only arithmetic error is
//! left, bounded by `tolerance::attention_allowed`. Pages are handed out in a shuffled order
//! with spare pages between requests, so a wrong block-table lookup reads the wrong data.
use cubecl::prelude::*;
use kiln_kernels::mla::{
    self, tree_mask_words, AttnMetadata, ContextRows, KvBShape, KvFormat, PagedKvCache,
    MAX_TREE_NODES,
};
use kiln_kernels::Precision;
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::absorb::KvB;
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{bf16_encode, bf16_round, pack_u16_words, pack_u8_words};
use kiln_reference::mla::{
    fp8_row_encode, mla_attention, AttnBatch, PagedKv, KV_DIM, KV_LORA_RANK,
};
use kiln_reference::mla_heads::mla_attention_heads;
use kiln_reference::rope::{softmax_scale, YarnConfig};
use kiln_reference::tolerance::{attention_allowed, compare, gamma, DType};

use crate::report::time_launch;
use crate::CaseReport;

/// Which launch (tiling) runs the case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnMode {
    Decode,
    Prefill,
}

/// One attention problem: per request, `q_lens[b]` new tokens at the end of `kv_lens[b]`.
#[derive(Clone, Debug)]
pub struct MlaCase {
    pub heads: usize,
    pub page_size: usize,
    pub q_lens: Vec<usize>,
    pub kv_lens: Vec<usize>,
    pub format: KvFormat,
    pub mode: AttnMode,
    pub seed: u64,
    /// Latent dims 384..512 of every KV row times 2^16 and the queries' same dims times
    /// 2^-16 (scores keep their size): fp8 tile scales past 2^7, where the tensor-core
    /// decode needs its second factor.
    pub huge_tile: bool,
    /// Each request's last queries are a random draft tree (1 to 32 nodes) with its mask.
    pub tree: bool,
}

impl MlaCase {
    fn shape(&self) -> String {
        let max_kv = self.kv_lens.iter().max().copied().unwrap_or(0);
        format!(
            "H={} B={} q<={} kv<={} page={}{}",
            self.heads,
            self.q_lens.len(),
            self.q_lens.iter().max().copied().unwrap_or(0),
            max_kv,
            self.page_size,
            if self.tree { " tree" } else { "" }
        )
    }
}

/// A shuffled page assignment: block tables, and how many pages the pool has.
fn assign_pages(rng: &mut Rng, kv_lens: &[usize], page_size: usize) -> (Vec<Vec<u32>>, usize) {
    let needed: Vec<usize> = kv_lens.iter().map(|l| l.div_ceil(page_size)).collect();
    let num_pages = needed.iter().sum::<usize>() + kv_lens.len() + 1;
    let mut pool: Vec<u32> = (0..num_pages as u32).collect();
    rng.shuffle(&mut pool);
    let mut next = 0;
    let tables = needed
        .iter()
        .map(|&n| {
            let table = pool[next..next + n].to_vec();
            next += n + 1; // leave a spare page between requests
            table
        })
        .collect();
    (tables, num_pages)
}

/// A random tree of 1 to `min(q_len, MAX_TREE_NODES)` nodes, each node's parent any
/// earlier node.
pub fn random_tree(rng: &mut Rng, q_len: usize) -> Vec<i32> {
    let n = 1 + rng.below(q_len.min(MAX_TREE_NODES));
    (0..n)
        .map(|k| if k == 0 { -1 } else { rng.below(k) as i32 })
        .collect()
}

/// Multiplies dims 384..512 of every 576-value row by `gain` (a power of two: exact).
fn scale_huge_tile(rows: &mut [f32], gain: f32) {
    for row in rows.chunks_mut(KV_DIM) {
        row[384..KV_LORA_RANK].iter_mut().for_each(|v| *v *= gain);
    }
}

/// A case's cache on the device and as the reference sees it (rows decoded from the
/// stored format), its batch and its metadata.
struct Stored {
    cache: PagedKvCache,
    seen: PagedKv,
    batch: AttnBatch,
    meta: AttnMetadata,
}

/// Fills a shuffled-page cache of `case`'s format with random rows (and random draft
/// trees where the case has them).
fn store<R: Runtime>(client: &ComputeClient<R>, case: &MlaCase, rng: &mut Rng) -> Stored {
    let (tables, num_pages) = assign_pages(rng, &case.kv_lens, case.page_size);
    let mut rows = normal_with_outliers(rng, num_pages * case.page_size * KV_DIM, 1.0);
    let gain = if case.huge_tile { 65536.0 } else { 1.0 };
    scale_huge_tile(&mut rows, gain);
    let stored = PagedKv {
        page_size: case.page_size,
        num_pages,
        rows,
    };
    let (words, seen) = match case.format {
        KvFormat::F32 => (
            stored.rows.iter().map(|x| x.to_bits()).collect(),
            stored.clone(),
        ),
        KvFormat::Bf16 => {
            let bits: Vec<u16> = stored.rows.iter().map(|&x| bf16_encode(x)).collect();
            (pack_u16_words(&bits), stored.bf16_round())
        }
        KvFormat::Fp8 => {
            let bytes: Vec<u8> = stored
                .rows
                .chunks(KV_DIM)
                .flat_map(fp8_row_encode)
                .collect();
            (pack_u8_words(&bytes), stored.fp8_round())
        }
    };
    let trees: Vec<Option<Vec<i32>>> = if case.tree {
        case.q_lens
            .iter()
            .map(|&q| Some(random_tree(rng, q)))
            .collect()
    } else {
        Vec::new()
    };
    let tree_masks = case.tree.then(|| {
        let words: Vec<u32> = case
            .q_lens
            .iter()
            .zip(&trees)
            .flat_map(|(&q, t)| tree_mask_words(q, t.as_deref().unwrap_or(&[-1])))
            .collect();
        DeviceArray::upload(client, &words)
    });
    let batch = AttnBatch {
        q_lens: case.q_lens.clone(),
        kv_lens: case.kv_lens.clone(),
        block_tables: tables,
        trees,
    };
    let max_blocks = batch
        .block_tables
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(1)
        .max(1);
    let mut table = vec![0u32; case.q_lens.len() * max_blocks];
    for (b, t) in batch.block_tables.iter().enumerate() {
        table[b * max_blocks..b * max_blocks + t.len()].copy_from_slice(t);
    }
    let mut cu = vec![0u32];
    for &l in &case.q_lens {
        cu.push(cu.last().unwrap() + l as u32);
    }
    let kv_lens: Vec<u32> = case.kv_lens.iter().map(|&l| l as u32).collect();
    let meta = AttnMetadata {
        batch: case.q_lens.len(),
        num_tokens: batch.num_tokens(),
        max_q_len: case.q_lens.iter().copied().max().unwrap_or(0),
        max_kv_len: case.kv_lens.iter().copied().max().unwrap_or(0),
        cu_q_lens: DeviceArray::upload(client, &cu),
        kv_lens: DeviceArray::upload(client, &kv_lens),
        block_table: DeviceArray::upload(client, &table),
        max_blocks,
        tree_masks,
    };
    let cache = PagedKvCache {
        data: DeviceArray::upload(client, &words),
        format: case.format,
        page_size: case.page_size,
        num_pages,
    };
    Stored {
        cache,
        seen,
        batch,
        meta,
    }
}

/// A report's dtype column for a KV format.
fn kv_dtype(format: KvFormat) -> &'static str {
    match format {
        KvFormat::F32 => "f32 kv",
        KvFormat::Bf16 => "bf16 kv",
        KvFormat::Fp8 => "fp8 kv",
    }
}

/// Runs the case on the device and against the reference.
pub fn run_mla<R: Runtime>(
    client: &ComputeClient<R>,
    case: &MlaCase,
    timing: bool,
) -> Result<CaseReport, KernelError> {
    let mut rng = Rng::new(case.seed);
    let Stored {
        cache,
        seen,
        batch,
        meta,
    } = store(client, case, &mut rng);
    let tokens = batch.num_tokens();
    let gain = if case.huge_tile { 65536.0 } else { 1.0 };
    let mut q = normal_with_outliers(&mut rng, tokens * case.heads * KV_DIM, 1.0);
    scale_huge_tile(&mut q, 1.0 / gain);
    let scale = softmax_scale(192, &YarnConfig::kimi_k2()) as f32;

    let q_dev = DeviceArray::upload(client, &q);
    let out = DeviceArray::filled(client, tokens * case.heads * KV_LORA_RANK, f32::NAN);
    let launch = || match case.mode {
        AttnMode::Decode => mla::mla_decode(
            client,
            &q_dev,
            case.heads,
            &cache,
            &meta,
            scale,
            &out,
            Precision::Bf16,
        ),
        AttnMode::Prefill => mla::mla_prefill(
            client,
            &q_dev,
            case.heads,
            &cache,
            &meta,
            scale,
            &out,
            Precision::Bf16,
        ),
    };
    launch()?;
    let actual = out.read(client);

    let reference = mla_attention(&q, case.heads, &seen, &batch, scale);
    // The tensor-core kernel multiplies bf16 operands (see `kiln_kernels::mla`).
    let tensor_cores = mla::uses_tensor_cores(client, case.format, Precision::Bf16);
    let operands = if tensor_cores {
        DType::BF16
    } else {
        DType::F32
    };
    let mut allowed = Vec::with_capacity(reference.out.len());
    let mut t = 0;
    for (&q_len, &kv_len) in case.q_lens.iter().zip(&case.kv_lens) {
        for _ in 0..q_len * case.heads {
            let bound = attention_allowed(
                KV_DIM,
                kv_len,
                reference.score_magnitude[t],
                reference.value_magnitude[t],
                operands,
                DType::F32,
                DType::F32,
            );
            allowed.extend(std::iter::repeat_n(bound, KV_LORA_RANK));
            t += 1;
        }
    }
    let cmp = compare(&actual, &reference.out, &allowed);
    let kernel = match (case.mode, tensor_cores) {
        (AttnMode::Decode, false) => "mla_decode",
        (AttnMode::Prefill, false) => "mla_prefill",
        (AttnMode::Decode, true) => "mla_decode (tensor cores)",
        (AttnMode::Prefill, true) => "mla_prefill (tensor cores)",
    };
    let dtype = kv_dtype(case.format);
    let mut report = CaseReport::from_comparison(
        kernel,
        case.shape(),
        dtype,
        format!("attention({operands:?} operands)"),
        &cmp,
    );
    report.time_us = time_launch(client, timing, || launch().expect("validated above"));
    Ok(report)
}

/// Runs the case in the per-head form (`kiln_kernels::mla::mla_prefill_heads`, causal: the
/// case's trees and mode are not used) with a random `kv_b_proj` of `nope` key and `v`
/// value rows per head, against `kiln_reference::mla_heads`.
pub fn run_mla_heads<R: Runtime>(
    client: &ComputeClient<R>,
    case: &MlaCase,
    nope: usize,
    v: usize,
    precision: Precision,
    chunk_rows: usize,
) -> Result<CaseReport, KernelError> {
    let mut rng = Rng::new(case.seed);
    let Stored {
        cache,
        seen,
        batch,
        meta,
    } = store(client, case, &mut rng);
    let tokens = batch.num_tokens();
    let q = normal_with_outliers(&mut rng, tokens * case.heads * (nope + 64), 1.0);
    // bf16 weights, as checkpoints ship kv_b_proj.
    let weight: Vec<f32> =
        normal_with_outliers(&mut rng, case.heads * (nope + v) * KV_LORA_RANK, 0.05)
            .iter()
            .map(|&w| bf16_round(w))
            .collect();
    let bits: Vec<u16> = weight.iter().map(|&w| bf16_encode(w)).collect();
    let kv_b = DeviceArray::upload(client, &pack_u16_words(&bits));
    let shape = KvBShape {
        heads: case.heads,
        nope,
        v,
    };
    let scale = softmax_scale(192, &YarnConfig::kimi_k2()) as f32;
    let context = ContextRows::new(client, &case.kv_lens, chunk_rows);
    let out = DeviceArray::filled(client, tokens * case.heads * v, f32::NAN);
    let q_dev = DeviceArray::upload(client, &q);
    mla::mla_prefill_heads(
        client, &q_dev, &cache, &meta, &context, &kv_b, shape, scale, &out, precision,
    )?;
    let kvb = KvB {
        weight: &weight,
        heads: case.heads,
        nope,
        v,
        kv_lora: KV_LORA_RANK,
    };
    let reference = mla_attention_heads(&q, &seen, &batch, &kvb, scale);
    // Keys and values are f32 dots of 512 bf16 weights (exact) with the decoded latent:
    // `gamma(512)` of their magnitudes, which the scores see through `nope` more products
    // (the head dim below) and the output takes as is (the `gamma` term). At `Bf16` the
    // expansion GEMM may round the latent to bf16 (inexact from an f32 cache), and the
    // tensor-core kernel rounds queries, keys, values and weights: operands at bf16, and the
    // values' rounding once more of their magnitude.
    let tensor_cores = mla::heads_on_tensor_cores(client, case.format, precision, shape);
    let (operands, value_rounding) = if precision == Precision::Bf16 {
        (DType::BF16, DType::BF16.unit_roundoff())
    } else {
        (DType::F32, 0.0)
    };
    let mut allowed = Vec::with_capacity(reference.out.len());
    let mut t = 0;
    for (&q_len, &kv_len) in case.q_lens.iter().zip(&case.kv_lens) {
        for _ in 0..q_len * case.heads {
            let value = reference.value_magnitude[t];
            let bound = attention_allowed(
                KV_LORA_RANK + nope + 64,
                kv_len,
                reference.score_magnitude[t],
                value,
                operands,
                DType::F32,
                DType::F32,
            ) + (gamma(KV_LORA_RANK + 2, DType::F32) + value_rounding) * value;
            allowed.extend(std::iter::repeat_n(bound, v));
            t += 1;
        }
    }
    let cmp = compare(&out.read(client), &reference.out, &allowed);
    let dtype = kv_dtype(case.format);
    Ok(CaseReport::from_comparison(
        "mla_prefill_heads",
        format!(
            "{} nope={nope} v={v} {precision:?} chunks={}",
            case.shape(),
            context.chunks()
        ),
        dtype,
        format!(
            "attention per head ({})",
            if tensor_cores { "bf16 mma" } else { "f32" }
        ),
        &cmp,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_match_the_reference_visibility() {
        let parents = vec![-1, 0, 0, 1, 2, 2];
        for q_len in [6, 9, 32, 40] {
            let kv_len = q_len + 7;
            let words = tree_mask_words(q_len, &parents);
            let batch = AttnBatch {
                q_lens: vec![q_len],
                kv_lens: vec![kv_len],
                block_tables: vec![vec![0]],
                trees: vec![Some(parents.clone())],
            };
            let window = kv_len - q_len.min(MAX_TREE_NODES);
            for (i, &word) in words.iter().enumerate() {
                let pos = kv_len - q_len + i;
                let seen: Vec<usize> = (0..=pos)
                    .filter(|&key| key < window || (word >> (key - window)) & 1 == 1)
                    .collect();
                assert_eq!(
                    seen,
                    batch.visible_positions(0, i),
                    "q_len {q_len} query {i}"
                );
            }
        }
    }
}
