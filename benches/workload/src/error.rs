//! The crate's one error type.
use thiserror::Error;

/// What can go wrong building or reading a workload.
#[derive(Debug, Error)]
pub enum WorkloadError {
    /// A parameter is out of its domain.
    #[error("invalid workload parameter {name}: {reason}")]
    InvalidParam {
        /// The parameter's field name.
        name: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A trace line is not a Mooncake record.
    #[error("trace line {line}: {reason}")]
    BadTraceLine {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading a trace or writing a report failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Drawing the chart failed.
    #[error("plot {path}: {reason}")]
    Plot {
        /// The output file.
        path: String,
        /// The drawing backend's message.
        reason: String,
    },
}
