//! One conformance result: what ran, how far it was from the oracle, and whether that is
//! inside the tolerance.
use std::time::{Duration, Instant};

use cubecl::prelude::*;
use kiln_reference::tolerance::Comparison;

/// The outcome of one case on one backend.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseReport {
    pub kernel: String,
    pub shape: String,
    pub dtype: String,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    /// How the bound was derived, e.g. `gamma_7168(f32)`.
    pub tolerance: String,
    pub passed: bool,
    /// Why it failed (empty when it passed).
    pub detail: String,
    /// Wall time of one warm launch and sync, when timing was asked for.
    pub time_us: Option<f64>,
}

impl CaseReport {
    /// A report from an element-wise comparison against the oracle.
    pub fn from_comparison(
        kernel: &str,
        shape: String,
        dtype: &str,
        tolerance: String,
        cmp: &Comparison,
    ) -> Self {
        CaseReport {
            kernel: kernel.to_string(),
            shape,
            dtype: dtype.to_string(),
            max_abs_err: cmp.max_abs_err,
            max_rel_err: cmp.max_rel_err,
            tolerance,
            passed: cmp.passed(),
            detail: if cmp.passed() {
                String::new()
            } else {
                cmp.to_string()
            },
            time_us: None,
        }
    }

    /// Panics with the whole report unless the case passed (for tests).
    pub fn assert_passed(&self) {
        assert!(
            self.passed,
            "{} {} {}: {}",
            self.kernel, self.shape, self.dtype, self.detail
        );
    }
}

/// Times one more launch of `launch` (already compiled by the checked run) until the device
/// is idle again; `None` unless `timing`.
pub fn time_launch<R: Runtime>(
    client: &ComputeClient<R>,
    timing: bool,
    mut launch: impl FnMut(),
) -> Option<f64> {
    if !timing {
        return None;
    }
    cubecl::future::block_on(client.sync()).expect("device sync before timing");
    let start = Instant::now();
    launch();
    cubecl::future::block_on(client.sync()).expect("device sync after timing");
    Some(Duration::as_secs_f64(&start.elapsed()) * 1e6)
}
