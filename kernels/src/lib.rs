//! kiln's GPU kernels, written once in CubeCL and generic over the runtime (wgpu, CUDA).
//!
//! Each kernel lives in its own module with its cube kernel, compile-time config, public
//! launch (validating every input and answering with a typed [`KernelError`]) and, where a
//! caller needs one, an `_unchecked` launcher that trusts its input:
//! - [`gemm`]: `C = A x W^T` with `W` in NVFP4 (dense and grouped for MoE) or bf16;
//! - [`mla`]: MLA attention in the absorbed (MQA) form over a paged KV cache, decode and
//!   prefill/extend, with bf16 or FlashMLA-layout fp8 KV;
//! - [`tree_verify`]: greedy and stochastic verification of speculative token trees;
//! - [`argmax`]: each row's largest value's index (greedy decoding on the device);
//! - [`sample`]: each row's token under its sampling parameters (greedy, temperature,
//!   top-k, top-p, min-p; Philox keyed by seed and position);
//! - [`moe`]: routing, dispatch to the grouped GEMM and the weighted combine;
//! - the model's glue: [`rmsnorm`] (with the fused residual add), [`rope`], [`activation`]
//!   (SwiGLU) and [`embedding`].
//!
//! The math each kernel computes is defined by `kiln-reference`, the oracle the conformance
//! suite compares against. The GEMM and MLA attention have CUDA tensor-core versions
//! (`mma.sync` on bf16 operands), chosen where [`tensor_cores::has_bf16_mma`] holds; the
//! portable kernels run everywhere else.
//! [`blackwell`] holds the native FP4 tensor-core path: a block-scaled MMA tile that compiles
//! for Blackwell (sm_120a), not dispatched yet.

pub mod activation;
pub mod arena;
pub mod argmax;
pub mod blackwell;
pub mod buffer;
pub mod cuda_source;
pub mod embedding;
pub mod error;
pub mod fill;
pub mod formats;
pub mod gemm;
pub mod mla;
pub mod moe;
mod reduce;
pub mod rmsnorm;
pub mod rope;
pub mod sample;
pub mod tensor_cores;
pub mod tree_verify;
mod warp_mma;

pub use buffer::{DeviceArray, PendingRead};
pub use error::KernelError;

/// What the GEMM and attention launches may round. With `Bf16` they use the tensor cores
/// where the device has them, rounding activations (GEMM) and queries and softmax weights
/// (attention) to bf16, each within its conformance tolerance; `Exact` keeps every operand
/// in f32 (the decode and portable kernels, and NVFP4 weights stay row-major): slower,
/// and what a comparison with an f32 model needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    #[default]
    Bf16,
    Exact,
}
