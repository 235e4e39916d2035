//! kiln's engine library: the model (configuration, checkpoint loading, forward pass), the
//! KV cache bookkeeping, the scheduler, the engine thread and the HTTP server. The `kiln`
//! binary in `main.rs` is its command line.
pub mod cache;
pub mod engine;
pub mod metrics;
pub mod model;
pub mod sampling;
pub mod scheduler;
pub mod server;
