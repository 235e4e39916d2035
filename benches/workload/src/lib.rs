//! Coding-agent workloads for benchmarking LLM servers (`kiln bench`), and the HTTP load
//! generator that drives them against any OpenAI-compatible server.
//!
//! - [`session`]: seeded closed-loop sessions over a shared system prompt, with
//!   heavy-tailed inputs and outputs, tool and user think times and tree-shaped sessions
//!   ([`SessionGenerator`] draws [`Session`]s from [`WorkloadParams`]).
//! - [`tokens`]: token ids (and text) for those sessions, exact where prefixes are shared.
//! - [`trace`]: Mooncake JSONL traces turned into token ids that keep their block sharing.
//! - [`metrics`]: per-request records, the summary of one concurrency point, the Pareto
//!   frontier; [`report`]: the JSON of a sweep and its summary table.
//! - [`plot`] (feature `plot`): the Pareto chart of a sweep, SVG and PNG.
//! - [`bench`] (feature `bench`): the load generator (`kiln bench`): closed-loop sessions
//!   and trace replay over HTTP with SSE, the server's own counters, progress bars. It
//!   does not link the engine, so it drives kiln, SGLang or vLLM alike.
//!
//! Everything but [`bench`] is without I/O; the router's simulator uses the same
//! sessions. The workload follows the seed's description of agent traffic (~100k tokens
//! in, ~500 out per request) and the shape of SGLang's `bench_serving` multi-turn and
//! Mooncake-replay modes.
#[cfg(feature = "bench")]
pub mod bench;
pub mod dist;
pub mod error;
pub mod metrics;
pub mod params;
#[cfg(feature = "plot")]
pub mod plot;
pub mod report;
pub mod session;
pub mod tokens;
pub mod trace;

pub use dist::Dist;
pub use error::WorkloadError;
pub use params::{TokenRange, WorkloadParams};
pub use session::{Request, Session, SessionGenerator, Turn, TurnKind};
