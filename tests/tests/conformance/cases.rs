//! The suite's one way to run a property: `cases` values drawn from a proptest strategy,
//! shrunk to the smallest failing value on failure, which the panic names.
use std::fmt::Debug;

use kiln_conformance::CaseReport;
use kiln_kernels::KernelError;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseResult, TestRunner};

/// Runs `test` on `cases` values of `strategy`; panics with the minimal failing value.
pub fn run_cases<S: Strategy>(cases: u32, strategy: &S, test: impl Fn(S::Value) -> TestCaseResult) {
    TestRunner::new(Config {
        cases,
        ..Config::default()
    })
    .run(strategy, test)
    .unwrap();
}

/// [`run_cases`] over conformance cases: every case launches and its report passes.
pub fn reports_pass<S: Strategy>(
    cases: u32,
    strategy: &S,
    report: impl Fn(&S::Value) -> Result<CaseReport, KernelError>,
) where
    S::Value: Debug,
{
    run_cases(cases, strategy, |case| {
        let report = report(&case).expect("valid case launches");
        prop_assert!(report.passed, "{case:?}: {}", report.detail);
        Ok(())
    });
}
