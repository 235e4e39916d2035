//! kiln's engine library: the model (configuration, checkpoint loading, forward pass) and,
//! later, the scheduler and server. The `kiln` binary in `main.rs` is its command line.
pub mod model;
pub mod sampling;
