//! The conformance suite as one test binary (one link, one file to copy to a GPU machine):
//! every kernel against `kiln-reference` on every backend the crate is built with.
//! Test names read `<family>::<backend>::<case>[::<dtype>]`.
mod arena;
mod argmax;
mod blackwell;
mod cases;
mod cuda_targets;
mod gemm;
mod glue;
#[cfg(feature = "cuda")]
mod launcher;
mod mla;
mod mla_heads;
mod moe;
mod nvrtc;
mod page_copy;
mod sample;
mod tree;
