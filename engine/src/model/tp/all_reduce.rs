//! An all-reduce over NVLink that one GPU cannot run, stood in for by device work of the
//! time it would take, so one GPU serving one rank's shapes (`kiln serve --synthetic ...
//! --tp-rank-of T`) pays for the two all-reduces of each layer.
//!
//! The time is **modelled**, not measured here: SGLang's custom all-reduce on H100 (NVLink
//! 4, as the H200 has), bf16, from the table in sgl-project/sglang PR 2904 ("optimize
//! custom allreduce kernel", 2025-01), latency by TP size and message size (read as bytes),
//! interpolated linearly between its sizes and extended past 1 MiB along its last segment.
//! The stand-in is a fill kernel over a scratch buffer sized by the fill rate measured at
//! start-up; its own launch cost (a few microseconds) comes on top, so small messages are
//! somewhat overcharged.
use std::time::Instant;

use cubecl::prelude::*;
use kiln_kernels::fill::fill_random_bits;
use kiln_kernels::{DeviceArray, KernelError};

use crate::model::gpu::ModelError;

/// Message sizes of the published table, bytes.
const SIZES: [f64; 6] = [512.0, 4096.0, 32768.0, 262144.0, 524288.0, 1048576.0];
/// Its latencies in microseconds at TP 2, 4 and 8.
const MICROS: [(usize, [f64; 6]); 3] = [
    (2, [3.7, 3.9, 4.5, 7.9, 12.5, 19.9]),
    (4, [4.8, 3.7, 4.8, 13.9, 20.2, 31.1]),
    (8, [5.9, 5.7, 7.8, 16.7, 22.1, 33.8]),
];

/// The TP sizes the model covers.
pub const MODELLED_RANKS: [usize; 3] = [2, 4, 8];

/// Modelled seconds of an all-reduce of `bytes` over `ranks` GPUs (`None` for a TP size
/// the table lacks).
pub fn modelled_seconds(ranks: usize, bytes: usize) -> Option<f64> {
    let (_, us) = MICROS.iter().find(|(r, _)| *r == ranks)?;
    let b = (bytes as f64).max(SIZES[0]);
    let i = SIZES
        .windows(2)
        .position(|w| b <= w[1])
        .unwrap_or(SIZES.len() - 2);
    let t = (b - SIZES[i]) / (SIZES[i + 1] - SIZES[i]);
    Some((us[i] + t * (us[i + 1] - us[i])) * 1e-6)
}

/// Device work standing in for the all-reduces of one rank.
#[derive(Debug)]
pub struct AllReduceStandIn {
    ranks: usize,
    /// Words the fill kernel writes per second on this device.
    words_per_second: f64,
}

impl AllReduceStandIn {
    /// Measures the fill rate on `client`'s device: eight fills of 64 MiB (within WebGPU's
    /// buffer limits) after a warm-up.
    pub fn calibrate<R: Runtime>(
        client: &ComputeClient<R>,
        ranks: usize,
    ) -> Result<Self, ModelError> {
        let (words, reps) = (16 << 20, 8);
        let buf = DeviceArray::<u32>::uninit(client, words);
        let sync = || {
            cubecl::future::block_on(client.sync())
                .map_err(|e| ModelError::Device(format!("{e:?}")))
        };
        fill_random_bits(client, &buf, 1, u32::MAX, 0)?;
        sync()?;
        let start = Instant::now();
        for seed in 0..reps {
            fill_random_bits(client, &buf, seed, u32::MAX, 0)?;
        }
        sync()?;
        let words_per_second = (reps as usize * words) as f64 / start.elapsed().as_secs_f64();
        tracing::info!(
            ranks,
            gb_per_s = words_per_second * 4.0 / 1e9,
            "all-reduce stand-in calibrated (modelled times: sglang PR 2904, H100)"
        );
        Ok(Self {
            ranks,
            words_per_second,
        })
    }

    /// Launches the stand-in for an all-reduce of `bytes`.
    pub fn run<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        bytes: usize,
    ) -> Result<(), KernelError> {
        let seconds = modelled_seconds(self.ranks, bytes).unwrap_or(0.0);
        let words = ((seconds * self.words_per_second) as usize).max(1);
        fill_random_bits(client, &DeviceArray::uninit(client, words), 3, u32::MAX, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_follows_the_published_table_and_its_last_slope() {
        let us = |r, b| modelled_seconds(r, b).unwrap() * 1e6;
        assert!((us(4, 4096) - 3.7).abs() < 1e-9);
        assert!((us(8, 1048576) - 33.8).abs() < 1e-9);
        assert!(
            (us(4, 100) - 4.8).abs() < 1e-9,
            "below the table: its first entry"
        );
        let mid = us(4, (262144 + 524288) / 2);
        assert!((mid - (13.9 + 20.2) / 2.0).abs() < 1e-9);
        assert!(us(4, 2 << 20) > 31.1, "past the table it keeps growing");
        assert_eq!(modelled_seconds(3, 4096), None);
    }
}
