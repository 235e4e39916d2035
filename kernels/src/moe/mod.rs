//! Mixture-of-experts routing around the grouped GEMM, all on the device (no host sync, so a
//! decode step can later be captured whole):
//! - [`route`]: DeepSeek-V3's router: sigmoid scores, `e_score_correction_bias` for the
//!   choice only, group-limited top-k, weights normalised and scaled;
//! - [`dispatch`]: a stable counting sort of the (token, choice) pairs by expert, giving the
//!   grouped GEMM's expert offsets, and [`gather_rows`] to lay the tokens out in that order;
//! - [`combine`]: the weighted sum of each token's expert outputs, plus the shared expert.
mod combine;
mod dispatch;
mod gate;

pub use combine::combine;
pub use dispatch::{dispatch, gather_rows, scatter_rows, Dispatch};
pub use gate::{route, GateParams, Routing, MAX_EXPERTS};
