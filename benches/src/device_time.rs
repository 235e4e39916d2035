//! Device time of short CubeCL launches on CUDA.
//!
//! CubeCL exposes no device events on its stream, and a warm CubeCL launch costs ~7 us of
//! host time, more than a small kernel takes on the device. So a spin kernel (a dependent
//! FMA chain, calibrated to a few ms) is launched first and `launches` kernels are queued
//! behind it; the per-launch device time is (spin + kernels) - (spin alone), the median of
//! the paired differences over [`REPS`] repetitions. Callers check that the host's enqueue
//! time ended before the spin did.
use std::time::{Duration, Instant};

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Paired repetitions per measurement.
pub const REPS: usize = 7;

pub type Client = ComputeClient<CudaRuntime>;

#[cube(launch)]
fn spin(x: &mut Array<f32>, iters: u32) {
    let mut v = x[0];
    for _ in 0..iters {
        v = v * 0.999_999 + 0.000_001;
    }
    x[0] = v;
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub fn sync<R: Runtime>(client: &ComputeClient<R>) {
    cubecl::future::block_on(client.sync()).expect("sync");
}

/// What one measurement saw.
pub struct Timed {
    /// Device seconds per launch.
    pub per_launch: f64,
    /// Host seconds to enqueue all launches.
    pub enqueue: f64,
    /// Seconds the spin alone took.
    pub spin: f64,
}

/// A calibrated spin kernel on `client`'s stream.
pub struct SpinTimer {
    client: Client,
    buf: Handle,
    iters: u32,
}

impl SpinTimer {
    /// A spin of about `target` on the device.
    pub fn new(client: &Client, target: Duration) -> Self {
        let mut timer = Self {
            client: client.clone(),
            buf: client.create_from_slice(f32::as_bytes(&[1.0f32])),
            iters: 1000,
        };
        let run = |timer: &Self| {
            let start = Instant::now();
            timer.spin();
            sync(&timer.client);
            start.elapsed()
        };
        run(&timer);
        timer.iters = 200_000;
        let t = (0..3).map(|_| run(&timer)).min().unwrap();
        timer.iters = (200_000.0 * target.as_secs_f64() / t.as_secs_f64()) as u32;
        timer
    }

    fn spin(&self) {
        spin::launch::<CudaRuntime>(
            &self.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            // SAFETY: the buffer holds one f32.
            unsafe { ArrayArg::from_raw_parts(self.buf.clone(), 1) },
            self.iters,
        );
    }

    /// Device time per launch of `launch(i)`, `launches` times behind the spin.
    pub fn time(&self, launches: usize, mut launch: impl FnMut(usize)) -> Timed {
        let (mut diffs, mut enqueue, mut spins) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..REPS {
            let start = Instant::now();
            self.spin();
            sync(&self.client);
            let alone = start.elapsed().as_secs_f64();
            let start = Instant::now();
            self.spin();
            for i in 0..launches {
                launch(i);
            }
            enqueue.push(start.elapsed().as_secs_f64());
            sync(&self.client);
            let with = start.elapsed().as_secs_f64();
            diffs.push((with - alone) / launches as f64);
            spins.push(alone);
        }
        Timed {
            per_launch: median(diffs),
            enqueue: median(enqueue),
            spin: median(spins),
        }
    }
}
