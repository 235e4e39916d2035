//! Shared pieces of kiln's GPU benchmarks: the Kimi-K2 layer shape and its byte counts,
//! device timing (`device_time`, CUDA) and the table-and-JSON report every binary prints.
#[cfg(feature = "cuda")]
pub mod device_time;
pub mod report;

use cubecl::prelude::*;
use kiln_core::model::ModelConfig;
use kiln_kernels::fill::{fill_random_bits, fill_random_records, Field};
use kiln_kernels::mla::KvFormat;
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::formats::bf16_decode;
use kiln_reference::mla::fp8_row_decode;

/// Word `i` of a buffer filled on the device by `kiln_kernels::fill::fill_random_bits(seed,
/// and_mask, or_mask)`, recomputed on the host (the same 32-bit hash), so a benchmark can
/// check results over gigabytes of device-generated operands without reading them back.
pub fn fill_word(i: u32, seed: u32, and_mask: u32, or_mask: u32) -> u32 {
    let x = i.wrapping_mul(2654435769).wrapping_add(seed);
    let state = x.wrapping_mul(747796405).wrapping_add(2891336453);
    let w = ((state >> ((state >> 28) + 4)) ^ state).wrapping_mul(277803737);
    (((w >> 22) ^ w) & and_mask) | or_mask
}

/// The fill of an fp8 KV cache: finite E4M3 codes and bf16 rope values under `masks`, and
/// its scale words (128..132 of each 164-word row) powers of two in `[2^-7, 1]`, as
/// `write_kv` stores them.
pub fn fp8_kv_scales() -> Field {
    Field {
        period: 164,
        words: 128..132,
        and_mask: 0x0380_0000,
        or_mask: 0x3c00_0000,
    }
}

/// Masks of a random KV cache's words ([`fill_kv_cache`]): bf16 pairs with exponents
/// 120..127 and any sign; fp8 rows: finite E4M3 codes and bf16 rope values (their scale
/// words: [`fp8_kv_scales`]).
const KV_BF16_MASKS: (u32, u32) = (0xBFFF_BFFF, 0x3C00_3C00);
const KV_FP8_MASKS: (u32, u32) = (0x3FBF_3FBF, 0x3C00_3C00);

/// Fills a KV cache of `format` with random valid rows from `seed` on the device;
/// [`kv_cache_row`] recomputes any row on the host.
pub fn fill_kv_cache<R: Runtime>(
    client: &ComputeClient<R>,
    data: &DeviceArray<u32>,
    format: KvFormat,
    seed: u32,
) -> Result<(), KernelError> {
    match format {
        KvFormat::Fp8 => fill_random_records(client, data, seed, KV_FP8_MASKS, &fp8_kv_scales()),
        _ => fill_random_bits(client, data, seed, KV_BF16_MASKS.0, KV_BF16_MASKS.1),
    }
}

/// Row `row` of a cache [`fill_kv_cache`] filled with `seed`, decoded as the kernels see it
/// (bf16 or fp8 rows).
pub fn kv_cache_row(format: KvFormat, row: usize, seed: u32) -> Vec<f32> {
    let words = format.words_per_row();
    let ws: Vec<u32> = (0..words)
        .map(|j| {
            let i = (row * words + j) as u32;
            let masks = if format == KvFormat::Fp8 {
                fp8_kv_scales().masks_of(i, KV_FP8_MASKS)
            } else {
                KV_BF16_MASKS
            };
            fill_word(i, seed, masks.0, masks.1)
        })
        .collect();
    match format {
        KvFormat::Fp8 => {
            let bytes: Vec<u8> = ws.iter().flat_map(|w| w.to_le_bytes()).collect();
            fp8_row_decode(&bytes).to_vec()
        }
        _ => ws
            .iter()
            .flat_map(|&w| [bf16_decode(w as u16), bf16_decode((w >> 16) as u16)])
            .collect(),
    }
}

/// The copy bandwidth measured on the H200 (read + write), the floor's denominator.
pub const HBM_BYTES_PER_S: f64 = 4.30e12;

/// Kimi K2's decoder (hidden 7168, 64 heads, MLA 512 + 64, 384 NVFP4 experts top-8 of
/// 2048, one shared expert), every layer an MoE layer, with a small vocabulary: the
/// embedding and lm_head are not part of a layer's time.
pub fn kimi_k2_layers(layers: usize, vocab: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: vocab,
        num_hidden_layers: layers,
        first_k_dense_replace: 0,
        ..ModelConfig::kimi_k2()
    }
}

/// Bytes of one layer's bf16 attention weights (q_a, q_b, kv_a, kv_b, o).
fn attention_weight_bytes(c: &ModelConfig) -> f64 {
    let (h, heads) = (c.hidden_size as f64, c.num_attention_heads as f64);
    let r = c.q_lora_rank.unwrap_or(0) as f64;
    let qk = (c.qk_nope_head_dim + c.qk_rope_head_dim) as f64;
    2.0 * (r * h
        + heads * qk * r
        + 576.0 * h
        + heads * (c.qk_nope_head_dim + c.v_head_dim) as f64 * 512.0
        + h * heads * c.v_head_dim as f64)
}

/// Bytes of one MoE layer's bf16 weights outside the routed experts (attention, router,
/// shared expert).
pub fn dense_weight_bytes(c: &ModelConfig) -> f64 {
    let h = c.hidden_size as f64;
    let router = c.n_routed_experts as f64 * h;
    let shared = 3.0 * h * (c.moe_intermediate_size * c.n_shared_experts) as f64;
    attention_weight_bytes(c) + 2.0 * (router + shared)
}

/// Bytes of one routed expert in NVFP4 (half a byte per weight, one E4M3 scale per 16).
pub fn expert_bytes(c: &ModelConfig) -> f64 {
    3.0 * (c.hidden_size * c.moe_intermediate_size) as f64 * (0.5 + 1.0 / 16.0)
}

/// Expected distinct experts touched by `tokens` tokens routed uniformly at random.
pub fn experts_touched(c: &ModelConfig, tokens: usize) -> f64 {
    let e = c.n_routed_experts as f64;
    e * (1.0 - (1.0 - 1.0 / e).powf((tokens * c.num_experts_per_tok) as f64))
}

/// Bytes one KV row takes in `kv` (1152 in bf16, 656 in fp8).
fn kv_row_bytes(kv: KvFormat) -> f64 {
    (4 * kv.words_per_row()) as f64
}

/// The bandwidth floor of one MoE layer's step: weights touched plus the KV rows read (in
/// `kv`), over [`HBM_BYTES_PER_S`].
pub fn floor_seconds(
    c: &ModelConfig,
    tokens: usize,
    kv_tokens_read: usize,
    kv: KvFormat,
) -> (f64, f64) {
    let bytes = dense_weight_bytes(c)
        + experts_touched(c, tokens) * expert_bytes(c)
        + kv_tokens_read as f64 * kv_row_bytes(kv);
    (bytes, bytes / HBM_BYTES_PER_S)
}

/// The bandwidth floor of a whole model's step, as [`floor_seconds`] for every layer (a
/// dense layer reads its bf16 MLP instead of the experts), plus the embedding rows and the
/// bf16 lm_head; routed experts and projections as `GpuModel::synthetic` stores them.
pub fn step_floor_seconds(
    c: &ModelConfig,
    tokens: usize,
    kv_tokens_read: usize,
    kv: KvFormat,
) -> (f64, f64) {
    let dense = c.first_k_dense_replace.min(c.num_hidden_layers);
    let moe = c.num_hidden_layers - dense;
    let (h, vocab) = (c.hidden_size as f64, c.vocab_size as f64);
    let dense_layer = attention_weight_bytes(c) + 2.0 * 3.0 * h * c.intermediate_size as f64;
    let bytes = moe as f64 * floor_seconds(c, tokens, kv_tokens_read, kv).0
        + dense as f64 * (dense_layer + kv_tokens_read as f64 * kv_row_bytes(kv))
        + 2.0 * h * (vocab + tokens as f64);
    (bytes, bytes / HBM_BYTES_PER_S)
}

/// cuBLAS's bf16 `C[m, n] = A[m, k] W[n, k]^T` (row-major), as the column-major call
/// `C^T = W A^T`: the peer both GEMM benches time kiln against.
#[cfg(feature = "cuda")]
pub fn cublas_bf16_nt(m: usize, n: usize, k: usize) -> cudarc::cublas::GemmConfig<half::bf16> {
    use cudarc::cublas::sys::cublasOperation_t;
    cudarc::cublas::GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: half::bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: half::bf16::ZERO,
        ldc: n as i32,
    }
}
