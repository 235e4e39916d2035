//! Tensor parallelism (TP = N ranks, one per GPU of a host): how the model is split, the
//! slicing of a checkpoint into per-rank weights ([`shard`]), and the sharded forward
//! ([`ShardedModel`]), which here runs the N ranks one after another on one device and
//! all-reduces on the host: the arithmetic of TP, checked against TP = 1, before NCCL.
//!
//! # Sharding (Megatron-LM, Shoeybi et al. 2019, applied to DeepSeek-V3's MLA and MoE)
//!
//! A column-parallel projection splits its output features (rows of the HF `[out, in]`
//! weight) into N contiguous slices; a row-parallel one splits its input features (columns)
//! and produces a partial sum that an all-reduce completes. Pairing them (column, then row)
//! needs one all-reduce per block and none inside it:
//!
//! - **Attention**: heads are split, `num_attention_heads / N` per rank. `q_b_proj` (or
//!   `q_proj`) and `kv_b_proj` are column-parallel: their rows are head-major
//!   (`[heads, qk_head_dim]`, `[heads, nope + v]`), so a rank's heads are one contiguous row
//!   slice, and absorption (`W_UK`, `W_UV`) is per head, so each rank absorbs its own. `o_proj`
//!   is row-parallel (its columns are `[heads, v_head_dim]`): each rank writes a partial
//!   `[tokens, hidden]`, then **all-reduce**.
//! - **The latent KV is replicated**: `kv_a_proj_with_mqa` (576 outputs), `kv_a_layernorm`
//!   and the paged cache of 576 values per token are on every rank, and every rank writes
//!   the same rows. The latent is shared by all heads (MQA in the absorbed form: each head's
//!   scores read all 576 values), so splitting it along its 576 values would need a sum of
//!   partial scores across ranks inside attention, for every head and cached token of every
//!   layer; splitting it by token would need a gather of the rows every layer. Replicating
//!   costs 576 values per token per rank (1.1 KiB in bf16, 61 layers: 70 KiB per token
//!   per GPU) and a `[576, hidden]` GEMM that every rank repeats, and needs no communication.
//!   `q_a_proj` and `q_a_layernorm` are replicated for the same reason: the 1536-wide query
//!   latent feeds every head, and its norm needs all of it.
//! - **Dense MLP and shared experts**: `gate_proj` and `up_proj` column-parallel (rows split),
//!   SwiGLU on the rank's slice, `down_proj` row-parallel (columns split), **all-reduce**.
//! - **Routed experts**: every expert is split the same way (gate/up rows, down columns),
//!   so each rank holds `1/N` of every expert, not `E/N` whole experts. The router (`gate`,
//!   `e_score_correction_bias`) is replicated: every rank routes identically, runs its slice
//!   of the chosen experts and of the shared expert, combines with the routing weights
//!   (linear, so partial sums combine), and one **all-reduce** ends the block. Why not expert
//!   parallelism: at decode batch 1 to 32 a step routes to 8 to ~200 experts; with whole
//!   experts per rank the busiest rank sets the step time, and routing skew makes it much
//!   busier than the mean, whereas slices give every rank exactly `1/N` of the bytes every
//!   step. It also keeps one collective (the all-reduce) instead of an all-to-all dispatch
//!   and combine. The cost: NVFP4 `down_proj` slices must start on the 16-element scale
//!   blocks (Kimi K2: 2048 / 8 = 256 columns per rank, fine) and the GEMMs are narrower.
//! - **Embedding and lm_head by vocabulary**: rank `r` holds rows `r V/N .. (r+1) V/N` of
//!   each, plus one padding row of zeros (a rank's vocabulary is its slice plus one padding
//!   id). Token ids of other ranks' slices map to the padding id, so a rank's lookup is the
//!   embedding where it owns the token and exact zeros elsewhere, and the **all-reduce** sums
//!   to the embedding exactly. lm_head gives each rank the logits of its slice (the padding
//!   column, always 0, is dropped), **gathered** along the vocabulary.
//! - Norms, RoPE and the residual stream are replicated; every rank adds the reduced
//!   `delta` to its own residual in the fused norm that follows each all-reduce.
//!
//! Per step: one all-reduce after the embedding, two per layer, one gather of the logits.
//!
//! # Numerics
//!
//! Every column-parallel output element is the same dot product as at TP = 1 (same inputs,
//! same K order), and the embedding sum adds exact zeros. Only the row-parallel projections
//! (`o_proj`, `down_proj`, experts' `down_proj`) change arithmetic: their K-long sums become
//! N partial sums of K/N terms added in f32 by the all-reduce: a reassociation, still at
//! most K roundings per term. Summation in any order is within `gamma_K(f32) * sum |a_i b_i|`
//! of the exact sum (Higham, Thm 3.1; `kiln_reference::tolerance`), so TP = N sits inside the
//! same f32 bound as TP = 1 and the two differ by at most `2 gamma_K` per projection, the
//! budget the device GEMMs are already allowed against the f64 reference; with rounding
//! errors of random sign the difference is nearer `sqrt(K) 2^-24` (`2^-17` at K = 8192).
//! The tests bound every logit by `2^-8` (bf16's unit roundoff) of its row's largest, the
//! bound of the HF conformance tests: the rounding any bf16 consumer of the logits adds.
//! It holds unless the perturbation flips a routing choice between two experts whose
//! scores lie within f32 rounding of each other.
//!
//! # What the multi-GPU run adds
//!
//! - **NCCL through cudarc, one process with one thread per GPU.** Each thread owns one CUDA
//!   context, one CubeCL client and one rank's [`crate::model::gpu::GpuModel`]; an NCCL
//!   communicator per rank comes from `ncclCommInitAll` (one call, no unique-id exchange
//!   over sockets), and the engine thread hands each step's [`crate::model::gpu::Batch`] to
//!   the rank threads by channel and takes rank 0's logits gather. One process keeps a
//!   single scheduler, page pool and prefix cache with no IPC (ranks must agree on every
//!   page table, which one address space gives for free), one copy of the tokenizer and the
//!   server, and one failure domain; a process per GPU would need to broadcast every batch
//!   and keep N schedulers in lock-step for no gain on one host. Each all-reduce here (host
//!   sum between pieces) becomes `ncclAllReduce(sum)` on the rank's stream between the same
//!   pieces of `RankStep`, in place on `delta` (and `residual` after the
//!   embedding), with no host synchronisation; the logits gather becomes `ncclAllGather`
//!   (or a gather to rank 0, the only rank that samples).
//! - `NCCL_NVLS_ENABLE=0` in the environment before the communicators are created:
//!   NVLink SHARP multicast can take a shared host's GPUs out of service.
//! - The benchmark: Kimi-K2-shaped layers at full width (synthetic weights, as
//!   `benches/layer_decode` does), per-layer decode step time at TP 1/2/4/8 and batch
//!   1/8/32, with the all-reduce share of the step, recorded in `benches/RESULTS.md`; and
//!   the TP = N vs TP = 1 logits test of `engine/tests/tp.rs` across real GPUs.
mod all_reduce;
mod model;
pub mod shard;

pub use all_reduce::{modelled_seconds, AllReduceStandIn, MODELLED_RANKS};
pub use model::{ShardedKvPool, ShardedModel};
pub use shard::{shard, RankWeights, SliceError, Split};

use super::gpu::ModelError;
use super::LoadError;

/// Why a model cannot be split or run across ranks.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error("rank {rank} does not exist with {ranks} ranks")]
    Rank { rank: usize, ranks: usize },
    #[error("{what} = {value} does not split evenly over {ranks} ranks")]
    Indivisible {
        what: &'static str,
        value: usize,
        ranks: usize,
    },
    #[error("slicing {tensor}: {source}")]
    Slice { tensor: String, source: SliceError },
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Model(#[from] ModelError),
}
