//! Why a model directory could not be loaded; every variant names the file and tensor.
use std::path::PathBuf;

/// A checkpoint that cannot be used, and exactly where it is wrong.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: not a valid safetensors file: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{dir}: no model*.safetensors files and no model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("tensor {tensor} is missing (looked in {files} file(s))")]
    MissingTensor { tensor: String, files: usize },
    #[error("{path}: tensor {tensor} has dtype {got}, expected {expected}")]
    Dtype {
        path: PathBuf,
        tensor: String,
        expected: String,
        got: String,
    },
    #[error("{path}: tensor {tensor} has shape {got:?}, the config implies {expected:?}")]
    Shape {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{path}: tensor {tensor}: {reason}")]
    Format {
        path: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("moving weights to the device: {0}")]
    Device(#[from] kiln_kernels::KernelError),
}
