//! What a launch costs the host, four ways (issue 29): CubeCL's own launch; the same call
//! through the `cuda-routed` runtime (`kiln_backends::routed`: CubeCL's client, kiln's
//! launcher behind its server); kiln's launcher called directly
//! (`kiln_backends::launcher`: CubeCL's generated CUDA C++ through NVRTC, launched on a
//! stream of kiln's); and the same launches captured once as a CUDA graph and replayed.
//!
//! The work is a decode layer's worth of small kernels: a chain of `--launches` SwiGLU
//! activations over one token's hidden width (7,168 floats), each reading the one before's
//! output, so every launch waits for the previous one as a layer's do. The four ways are
//! validated first (the chain's last output is the same bits each way), then timed:
//! `--reps` chains each, medians reported: host time to issue the chain (per launch), and
//! wall time until the device has finished it. kiln's arguments (device addresses looked
//! up through CubeCL) are built before the timed issue, as a step's would be kept; what
//! building them costs is its own column. CUDA only.

kiln_benches::cuda_main!(cost::run, "launches CUDA kernels four ways");

#[cfg(feature = "cuda")]
mod cost {
    use std::time::Instant;

    use clap::Parser;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use kiln_backends::launcher::{Args, Kernel, Launcher};
    use kiln_backends::routed::KilnCuda;
    use kiln_benches::device_time::{median, sync};
    use kiln_benches::report::{fixed, report};
    use kiln_kernels::activation::{silu_mul, silu_mul_source};
    use kiln_kernels::DeviceArray;
    use kiln_reference::data::{normal_with_outliers, Rng};

    #[derive(Parser)]
    #[command(about = "Host cost of a CUDA launch: CubeCL's, kiln's launcher's, a graph's")]
    struct Cli {
        /// Launches in a chain (a Kimi-K2 decode layer issues about 20)
        #[arg(long, default_value_t = 20)]
        launches: usize,
        /// Elements each launch works on (7,168: one token's hidden width)
        #[arg(long, default_value_t = 7168)]
        elements: usize,
        /// Chains timed per way (medians reported)
        #[arg(long, default_value_t = 50)]
        reps: usize,
        /// Write the rows as JSON here
        #[arg(long)]
        json: Option<std::path::PathBuf>,
    }

    #[derive(serde::Serialize)]
    struct Row {
        way: &'static str,
        launches: usize,
        /// Host microseconds to issue the chain, per launch.
        issue_us_per_launch: f64,
        /// Host microseconds to build one launch's arguments (kiln's launcher only).
        args_us_per_launch: Option<f64>,
        /// Wall microseconds from the first issue until the device finished the chain.
        wall_us_per_chain: f64,
    }

    type Client = ComputeClient<CudaRuntime>;

    /// The chain's buffers: `x` and `y` take turns as input and output, `up` is shared.
    struct Chain {
        x: DeviceArray<f32>,
        y: DeviceArray<f32>,
        up: DeviceArray<f32>,
    }

    impl Chain {
        fn new<R: Runtime>(client: &ComputeClient<R>, start: &[f32], up: &[f32]) -> Self {
            Chain {
                x: DeviceArray::upload(client, start),
                y: DeviceArray::filled(client, start.len(), f32::NAN),
                up: DeviceArray::upload(client, up),
            }
        }

        /// Launch `i`'s input and output.
        fn step(&self, i: usize) -> (&DeviceArray<f32>, &DeviceArray<f32>) {
            match i % 2 {
                0 => (&self.x, &self.y),
                _ => (&self.y, &self.x),
            }
        }

        /// The buffer the chain's last launch wrote.
        fn last(&self, launches: usize) -> &DeviceArray<f32> {
            self.step(launches - 1).1
        }

        fn args(&self, client: &Client, i: usize) -> Args {
            let (input, output) = self.step(i);
            let mut args = Args::default();
            args.array(client, input)
                .array(client, &self.up)
                .array(client, output);
            args
        }
    }

    /// One way's row from `reps` runs of `run`, which issues one chain of `launches` and
    /// returns the seconds it spent building arguments (where it builds any), issuing, and
    /// until the device finished; medians.
    fn timed(
        way: &'static str,
        launches: usize,
        reps: usize,
        mut run: impl FnMut() -> anyhow::Result<(Option<f64>, f64, f64)>,
    ) -> anyhow::Result<Row> {
        let (mut built, mut issued, mut wall) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let (b, i, w) = run()?;
            built.extend(b);
            issued.push(i);
            wall.push(w);
        }
        let per_launch = |t: f64| t * 1e6 / launches as f64;
        Ok(Row {
            way,
            launches,
            issue_us_per_launch: per_launch(median(issued)),
            args_us_per_launch: (!built.is_empty()).then(|| per_launch(median(built))),
            wall_us_per_chain: median(wall) * 1e6,
        })
    }

    fn bits<R: Runtime>(client: &ComputeClient<R>, a: &DeviceArray<f32>) -> Vec<u32> {
        a.read(client).into_iter().map(f32::to_bits).collect()
    }

    /// Issues the chain over `chain` through `client`'s runtime: one `silu_mul` a launch.
    fn issue<R: Runtime>(client: &ComputeClient<R>, chain: &Chain, n: usize) {
        for i in 0..n {
            let (input, output) = chain.step(i);
            silu_mul(client, input, &chain.up, output).expect("silu_mul");
        }
    }

    pub fn run() -> anyhow::Result<()> {
        let cli = Cli::parse();
        anyhow::ensure!(cli.launches > 0 && cli.elements > 0 && cli.reps > 0);
        let client = CudaRuntime::client(&CudaDevice::default());
        let launcher = Launcher::new()?;
        let source = silu_mul_source()?;
        let kernel: Kernel = launcher.load(&source)?;
        let cubes = (cli.elements as u32).div_ceil(source.cube_dim.x);
        let stream = launcher.stream().clone();
        let mut rng = Rng::new(29);
        let start = normal_with_outliers(&mut rng, cli.elements, 1.0);
        // |up| < ~1 keeps the chain's values finite over many launches.
        let up = normal_with_outliers(&mut rng, cli.elements, 0.3);
        let n = cli.launches;

        let cubecl_chain = Chain::new(&client, &start, &up);
        let routed = KilnCuda::client(&CudaDevice::default());
        let routed_chain = Chain::new(&routed, &start, &up);
        sync(&routed);
        let kiln_chain = Chain::new(&client, &start, &up);
        let kiln_args = |chain: &Chain| (0..n).map(|i| chain.args(&client, i)).collect::<Vec<_>>();
        let kiln_issue = |args: Vec<Args>| {
            for a in args {
                // SAFETY: every array holds `elements` floats; the kernel reads its input and
                // `up` and writes its output, all live for the chain.
                unsafe { kernel.launch(&stream, (cubes, 1, 1), a) }.expect("launch");
            }
        };
        let graph_chain = Chain::new(&client, &start, &up);
        sync(&client); // the uploads are on CubeCL's stream: done before kiln's reads

        // Validate: one chain each way from the same start.
        issue(&client, &cubecl_chain, n);
        let want = bits(&client, cubecl_chain.last(n));
        issue(&routed, &routed_chain, n);
        anyhow::ensure!(
            bits(&routed, routed_chain.last(n)) == want,
            "the routed runtime's launches differ from CubeCL's"
        );
        kiln_issue(kiln_args(&kiln_chain));
        stream.synchronize()?;
        anyhow::ensure!(
            bits(&client, kiln_chain.last(n)) == want,
            "kiln's launches differ from CubeCL's"
        );
        let graph_args = kiln_args(&graph_chain);
        let graph = launcher.capture(|s| {
            for a in graph_args {
                // SAFETY: as in `kiln_issue`; the chain's buffers outlive the graph.
                unsafe { kernel.launch(s, (cubes, 1, 1), a) }?;
            }
            Ok(())
        })?;
        graph.launch()?;
        stream.synchronize()?;
        anyhow::ensure!(
            bits(&client, graph_chain.last(n)) == want,
            "the replayed graph differs from CubeCL's launches"
        );

        let mut rows = Vec::new();
        rows.push(timed("CubeCL launch", n, cli.reps, || {
            let t = Instant::now();
            issue(&client, &cubecl_chain, n);
            let issued = t.elapsed().as_secs_f64();
            sync(&client);
            Ok((None, issued, t.elapsed().as_secs_f64()))
        })?);
        rows.push(timed("cuda-routed", n, cli.reps, || {
            let t = Instant::now();
            issue(&routed, &routed_chain, n);
            let issued = t.elapsed().as_secs_f64();
            sync(&routed);
            Ok((None, issued, t.elapsed().as_secs_f64()))
        })?);
        rows.push(timed("kiln launcher", n, cli.reps, || {
            let t = Instant::now();
            let args = kiln_args(&kiln_chain);
            let built = t.elapsed().as_secs_f64();
            let t = Instant::now();
            kiln_issue(args);
            let issued = t.elapsed().as_secs_f64();
            stream.synchronize()?;
            Ok((Some(built), issued, t.elapsed().as_secs_f64()))
        })?);
        rows.push(timed("graph replay", n, cli.reps, || {
            let t = Instant::now();
            graph.launch()?;
            let issued = t.elapsed().as_secs_f64();
            stream.synchronize()?;
            Ok((None, issued, t.elapsed().as_secs_f64()))
        })?);
        report(
            &[
                ("way", 14),
                ("launches", 8),
                ("issue us/launch", 15),
                ("args us/launch", 14),
                ("wall us/chain", 13),
            ],
            &rows,
            |r| {
                vec![
                    r.way.to_string(),
                    r.launches.to_string(),
                    fixed(r.issue_us_per_launch, 2),
                    r.args_us_per_launch.map_or("-".into(), |a| fixed(a, 2)),
                    fixed(r.wall_us_per_chain, 1),
                ]
            },
            cli.json.as_ref(),
        )
    }
}
