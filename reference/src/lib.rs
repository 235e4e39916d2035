//! kiln's numerical oracle: naive, obviously-correct Rust for the math of every kiln
//! kernel.
//!
//! Each module computes one operation the way its reference implementation (HF
//! transformers' DeepseekV3, DeepSeek-V3's inference code, FlashMLA, ModelOpt)
//! defines it, in f64 wherever the result is compared against a kernel, so the
//! oracle's own rounding is negligible next to the kernel's. Kernel tests compare
//! against these results with the bounds of [`tolerance`], the project's one
//! tolerance helper. The crate has no runtime dependencies other than `kiln-core` and no
//! global state; speed is not a goal, clarity is.
//!
//! The number formats, the NVFP4 layout, the model's hyper-parameters, YaRN's frequencies
//! and the seeded generator live in `kiln-core`, which the runtime links instead of this
//! crate; they are re-exported here ([`formats`], [`nvfp4`], [`data::Rng`],
//! [`model::ModelConfig`], [`rope::YarnConfig`]) so the oracle reads as one namespace.

pub mod absorb;
pub mod activation;
pub mod argmax;
pub mod data;
pub use kiln_core::formats;
pub mod gemm;
pub mod mla;
pub mod mla_heads;
pub mod model;
pub mod moe_gate;
pub mod norm;
pub use kiln_core::nvfp4;
pub mod rope;
pub mod sampling;
pub mod softmax;
pub mod stats;
pub mod tolerance;
pub mod tree;
