//! Sampling on the device (`kiln_kernels::sample`) at Kimi K2's vocabulary (163,840) on
//! CUDA, against what it replaces: reading the rows of logits back and sampling them on the
//! host (`kiln::sampling::sample`, the same draw). Batches 1, 8, 32 and 64; four kinds of
//! rows: greedy, temperature 0.7 alone, temperature 0.7 with top-p 0.95 and top-k 40 over
//! peaked rows (a model's: a few tokens far above a normal background), and the same
//! filters over flat rows (top-p 0.5 of a near-uniform row: the winner is rejected and the
//! race rerun most often, the kernel's worst case).
//!
//! Each point is first checked against `kiln_reference::sampling::draw` (every row; rows
//! whose race is a near-tie in f32 are skipped and counted), then timed: the kernel's device
//! time per launch with `kiln_benches::device_time` (20 launches queued behind a spin
//! kernel), the read-back of the ids and of the logits, and the host's sampling of the read
//! rows (wall clock, median of 5). `benches/gpu/sample_peer.py` times PyTorch's sampling of
//! the same shapes (softmax + multinomial, and vLLM's sort-based top-k/top-p) for the ratio.
//!
//! Prints a table and writes JSON to the path given as the first argument.

kiln_benches::cuda_main!(sampling::run, "times device sampling on CUDA");

#[cfg(feature = "cuda")]
mod sampling {
    use std::time::{Duration, Instant};

    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::*;
    use kiln_benches::device_time::{median, sync, Client, SpinTimer};
    use kiln_benches::report::{fixed, report};
    use kiln_core::sampling::SamplingRow;
    use kiln_kernels::sample::sample_rows;
    use kiln_kernels::DeviceArray;
    use kiln_reference::data::{normal_with_outliers, Rng};

    const VOCAB: usize = 163_840;
    const BATCHES: [usize; 4] = [1, 8, 32, 64];
    const LAUNCHES: usize = 20;

    #[derive(serde::Serialize)]
    struct Point {
        kind: &'static str,
        batch: usize,
        /// Device time of one sampling launch.
        device_us: f64,
        /// Reading back the ids (a sync and `batch` words).
        ids_read_us: f64,
        /// Reading back the rows of logits, then sampling them on the host.
        logits_read_ms: f64,
        host_sample_ms: f64,
        /// Rows checked token for token against the oracle, of `batch`.
        checked: usize,
    }

    /// Rows of the given kind and the parameters each row is drawn with.
    fn rows(rng: &mut Rng, kind: &str, batch: usize) -> (Vec<f32>, Vec<SamplingRow>) {
        let mut x = normal_with_outliers(rng, batch * VOCAB, 1.5);
        let row = |temperature, top_p, top_k| SamplingRow {
            temperature,
            top_p,
            top_k,
            min_p: 0.0,
            seed: 7,
            position: 0,
        };
        let params = match kind {
            "greedy" => row(0.0, 1.0, 0),
            "temperature" => row(0.7, 1.0, 0),
            "filtered" => row(0.7, 0.95, 40),
            _ => row(1.0, 0.5, 0),
        };
        if kind == "flat" {
            x.iter_mut().for_each(|v| *v *= 0.01);
        } else {
            // A model's row: a few tokens far above the rest.
            for r in x.chunks_mut(VOCAB) {
                for (k, lift) in [12.0, 10.5, 10.0, 9.0, 8.0].into_iter().enumerate() {
                    r[(k * 7919 + rng.below(VOCAB)) % VOCAB] += lift;
                }
            }
        }
        let params = (0..batch)
            .map(|i| SamplingRow {
                position: 1000 + i as u32,
                seed: 7 + i as u64,
                ..params
            })
            .collect();
        (x, params)
    }

    fn wall<T>(mut f: impl FnMut() -> T) -> f64 {
        median(
            (0..5)
                .map(|_| {
                    let start = Instant::now();
                    std::hint::black_box(f());
                    start.elapsed().as_secs_f64()
                })
                .collect(),
        )
    }

    fn measure(
        client: &Client,
        timer: &SpinTimer,
        rng: &mut Rng,
        kind: &'static str,
        batch: usize,
    ) -> anyhow::Result<Point> {
        let (x, params) = rows(rng, kind, batch);
        let logits = DeviceArray::upload(client, &x);
        let words: Vec<u32> = params.iter().flat_map(|r| r.words()).collect();
        let words = DeviceArray::upload(client, &words);
        let ids = DeviceArray::filled(client, batch, u32::MAX - 1);
        sample_rows(client, &logits, batch, VOCAB, &words, &ids)?;
        let got = ids.read(client);
        let mut checked = 0;
        for (i, (row, p)) in x.chunks(VOCAB).zip(&params).enumerate() {
            let want = kiln_reference::sampling::draw(row, p);
            if !p.is_sampled() || want.margin > 1e-3 {
                anyhow::ensure!(
                    got[i] == want.token,
                    "{kind} B={batch} row {i}: {} != {}",
                    got[i],
                    want.token
                );
                checked += 1;
            }
        }
        let timed = timer.time(LAUNCHES, |_| {
            sample_rows(client, &logits, batch, VOCAB, &words, &ids).expect("validated above");
        });
        anyhow::ensure!(timed.enqueue < timed.spin, "launches outran the spin");
        sync(client);
        let ids_read = wall(|| ids.read(client));
        let logits_read = wall(|| logits.read(client));
        let host = x.clone();
        let host_sample = wall(|| {
            host.chunks(VOCAB)
                .zip(&params)
                .map(|(row, p)| kiln::sampling::sample(row, p))
                .collect::<Vec<_>>()
        });
        Ok(Point {
            kind,
            batch,
            device_us: timed.per_launch * 1e6,
            ids_read_us: ids_read * 1e6,
            logits_read_ms: logits_read * 1e3,
            host_sample_ms: host_sample * 1e3,
            checked,
        })
    }

    pub fn run() -> anyhow::Result<()> {
        let client = CudaRuntime::client(&CudaDevice::default());
        let timer = SpinTimer::new(&client, Duration::from_millis(3));
        let mut rng = Rng::new(20_261_206);
        let mut points = Vec::new();
        for kind in ["greedy", "temperature", "filtered", "flat"] {
            for batch in BATCHES {
                let p = measure(&client, &timer, &mut rng, kind, batch)?;
                eprintln!("done {kind} B={batch}: {:.1} us", p.device_us);
                points.push(p);
            }
        }
        report(
            &[
                ("kind", 11),
                ("B", 3),
                ("device us", 9),
                ("ids read us", 11),
                ("logits read ms", 14),
                ("host ms", 8),
                ("checked", 7),
            ],
            &points,
            |p| {
                vec![
                    p.kind.to_string(),
                    p.batch.to_string(),
                    fixed(p.device_us, 1),
                    fixed(p.ids_read_us, 1),
                    fixed(p.logits_read_ms, 2),
                    fixed(p.host_sample_ms, 2),
                    format!("{}/{}", p.checked, p.batch),
                ]
            },
            std::env::args().nth(1),
        )
    }
}
