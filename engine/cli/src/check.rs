//! `kiln check`: every kernel against the reference on realistic shapes, as a table.
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use cubecl::prelude::*;
use kiln_backends::{with_backend, BackendKind, BackendVisitor, DeviceReport};
use kiln_conformance::check::realistic_cases;
use kiln_conformance::CaseReport;

#[derive(Args)]
pub struct CheckArgs {
    /// Backend to check: wgpu, cuda or cuda-routed (default: KILN_BACKEND, else cuda if compiled in).
    #[arg(long)]
    backend: Option<String>,
    /// Also write the device report and every case's result to this JSON file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

struct RunCases;

impl BackendVisitor for RunCases {
    type Output = anyhow::Result<(DeviceReport, Vec<CaseReport>)>;

    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) -> Self::Output {
        tracing::info!(device = %report.name, backend = %report.backend, "running kernel checks");
        let cases = realistic_cases();
        let mut results = Vec::with_capacity(cases.len());
        for (i, case) in cases.iter().enumerate() {
            tracing::info!("case {}/{}: {case:?}", i + 1, cases.len());
            let result = case
                .run(&client, true)
                .with_context(|| format!("launching {case:?}"))?;
            results.push(result);
        }
        Ok((report, results))
    }
}

pub fn run(args: CheckArgs) -> anyhow::Result<()> {
    let kind = BackendKind::choose(args.backend.as_deref())?;
    let (device, results) = with_backend(kind, RunCases)??;
    print!("{device}");
    println!();
    print_table(&device, &results);
    if let Some(path) = &args.json {
        let json = serde_json::json!({ "device": device, "cases": results });
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
    for r in &failed {
        eprintln!("FAILED {} {} {}: {}", r.kernel, r.shape, r.dtype, r.detail);
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{} of {} checks failed",
        failed.len(),
        results.len()
    );
    println!("{} passed, 0 failed", results.len());
    Ok(())
}

fn print_table(device: &DeviceReport, results: &[CaseReport]) {
    println!(
        "{:<19} {:<34} {:<7} {:<10} {:>10} {:>10} {:<28} {:<5} {:>12}",
        "kernel", "shape", "backend", "dtype", "max abs", "max rel", "tolerance", "pass", "time"
    );
    for r in results {
        let time = r.time_us.map_or("-".to_string(), |t| format!("{t:.1} us"));
        println!(
            "{:<19} {:<34} {:<7} {:<10} {:>10.2e} {:>10.2e} {:<28} {:<5} {:>12}",
            r.kernel,
            r.shape,
            device.backend.to_string(),
            r.dtype,
            r.max_abs_err,
            r.max_rel_err,
            r.tolerance,
            if r.passed { "yes" } else { "NO" },
            time
        );
    }
}
