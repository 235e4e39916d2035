//! What kiln's runtime and its numerical oracle (`kiln-reference`) share, with no
//! dependencies: the model's hyper-parameters, the number formats every quantized kernel
//! reproduces bit for bit, the NVFP4 weight layout, YaRN's frequencies and a seeded RNG.
//! The engine, the router and the workload generator link this crate instead of the
//! oracle; the oracle re-exports it and keeps the naive maths (GEMM, attention, routing,
//! the forward pass) that kernels are checked against.
//!
//! - [`model`]: [`model::ModelConfig`] (named as in the HF config) and a host [`model::Tensor`].
//! - [`formats`]: E2M1, E4M3FN and bf16 encode/decode, word packing.
//! - [`nvfp4`]: [`nvfp4::Nvfp4Matrix`], ModelOpt's NVFP4 layout and its quantizer.
//! - [`rope`]: [`rope::YarnConfig`], inverse frequencies, cos/sin and softmax scales.
//! - [`rng`]: [`rng::Rng`], seeded xoshiro256**.
//! - [`philox`]: Philox4x32-10, the counter-based generator device sampling draws from.
//! - [`sampling`]: [`sampling::SamplingRow`], how a row of logits is sampled.
//! - [`session`]: the request headers that name an agent session.
pub mod formats;
pub mod model;
pub mod nvfp4;
pub mod philox;
pub mod rng;
pub mod rope;
pub mod sampling;
pub mod session;
