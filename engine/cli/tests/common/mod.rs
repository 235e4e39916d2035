//! What the binary's end-to-end tests share: a `kiln serve` process on a free port.
// Each test binary uses part of it.
#![allow(dead_code)]
pub mod server;
