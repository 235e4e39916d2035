//! kiln-router: `kiln route`, one endpoint in front of many kiln replicas.
//!
//! Replicas hold KV cache, so where a request lands decides whether its long prefix is
//! reused or recomputed. The router keeps sessions on the replica holding their prefix,
//! places new sessions by load, splits thick sessions, and rebalances gently on scale-up
//! (the routing section of the seed write-up). Layout:
//!
//! - [`hashing`], [`session`]: stable hashes, rendezvous hashing, session keys;
//! - [`policy`], [`decisions`], [`placer`]: policies, pure placement decisions and the
//!   placement state shared by proxy and simulator;
//! - [`scrape`], [`metrics`]: replica /metrics parsing and the router's own /metrics;
//! - [`replicas`], [`proxy`], [`health`]: replica lists and reloads, the reverse proxy,
//!   health checks;
//! - [`sim`]: the deterministic simulator behind `kiln route --simulate`;
//! - [`cli`]: the `kiln route` arguments and entry point.

pub mod cli;
pub mod decisions;
pub mod error;
pub mod hashing;
pub mod health;
pub mod metrics;
pub mod placer;
pub mod policy;
pub mod proxy;
pub mod replicas;
pub mod scrape;
pub mod session;
pub mod sim;

pub use error::RouterError;
