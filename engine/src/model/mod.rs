//! The DeepSeek-V3 / Kimi-K2 model: what an HF model directory declares ([`config`]), the
//! weights its safetensors files hold ([`weights`]), validated against each other, and the
//! model on the device ([`gpu`]), and its tokenizer ([`tokenizer`]).
pub mod config;
pub mod default_model;
pub mod gpu;
pub mod tiktoken;
pub mod tokenizer;
pub mod tp;
pub mod weights;

pub use config::{ModelSpec, QuantMethod};
pub use weights::{Checkpoint, LoadError, LoadedWeight};
