//! The router's error type.

use std::path::PathBuf;

/// Everything `kiln route` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The replica list file could not be read.
    #[error("cannot read replica file {path}: {source}")]
    ReplicaFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A replica address is not an http:// URL.
    #[error("replica {address:?} is not an http:// URL (line {line} of {origin})")]
    BadReplica {
        /// The address as given.
        address: String,
        /// Where it came from (a file or the command line).
        origin: String,
        /// Its line (1 on the command line).
        line: usize,
    },
    /// No replica was given and the router is not simulating.
    #[error("no replicas: pass --replica URL or --replicas-file FILE")]
    NoReplicas,
    /// Binding the listening socket failed.
    #[error("cannot listen on {address}: {source}")]
    Bind {
        /// The address.
        address: String,
        /// Why.
        source: std::io::Error,
    },
    /// Any other I/O failure (serving, writing the JSON report).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// Why.
        source: std::io::Error,
    },
    /// The simulator's workload parameters are invalid.
    #[error("invalid workload: {0}")]
    Workload(#[from] kiln_workload::error::WorkloadError),
    /// The HTTP client could not be built.
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}
