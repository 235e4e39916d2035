//! The conformance suite: run a kernel on a backend, run `kiln-reference` on the same
//! inputs, compare within the tolerance the reference derives, and report.
//!
//! Each kernel family has a case type describing one problem (shape, seed, format) and a
//! `run_*` function generic over the runtime. Outputs are poisoned (NaN, or an impossible
//! index) before every launch, inputs are never zeros. The integration tests under
//! `tests/` drive these with proptest on every enabled backend; `kiln check` runs
//! [`check::realistic_cases`] and prints the reports as a table.
pub mod activation;
pub mod check;
pub mod gemm;
pub mod mla;
pub mod report;
pub mod tree;

pub use activation::Activation;
pub use report::CaseReport;
