//! kiln's engine library: the model (configuration, checkpoint loading, forward pass), the
//! KV cache bookkeeping, the scheduler, the engine thread and (feature `server`, on by
//! default) the HTTP server. It has no command line: the `kiln` binary is the `kiln-cli`
//! crate (`engine/cli/`), and errors here are typed for it to word.
pub mod cache;
pub mod engine;
pub mod metrics;
pub mod model;
pub mod sampling;
pub mod scheduler;
#[cfg(feature = "server")]
pub mod server;
pub mod speculative;
