//! `kiln info`: the device report of the chosen backend.
use clap::Args;
use cubecl::prelude::*;
use kiln_backends::{with_backend, BackendKind, BackendVisitor, DeviceReport};

#[derive(Args)]
pub struct InfoArgs {
    /// Backend to report on: wgpu, cuda or cuda-routed (default: KILN_BACKEND, else cuda if compiled in).
    #[arg(long)]
    backend: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

struct Report;

impl BackendVisitor for Report {
    type Output = DeviceReport;
    fn visit<R: Runtime>(self, _client: ComputeClient<R>, report: DeviceReport) -> DeviceReport {
        report
    }
}

pub fn run(args: InfoArgs) -> anyhow::Result<()> {
    let kind = BackendKind::choose(args.backend.as_deref())?;
    let report = with_backend(kind, Report)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}
