//! What the simulator reports per policy: the table, its tails and the JSON.
//!
//! Concurrency is a replica's running plus queued requests, sampled every tick on every
//! replica after warm-up and pooled; `var_over_mean` is its variance over its mean
//! (1 for Poisson-dispersed load, the write-up's router reached < 0.5). Affinity is the
//! share of requests past a session's first turn landing on a replica that holds the
//! session's whole history before the turn's new input. Moves per scale event count every session move from the first scale
//! event to the end of the run, divided by the number of events.

use super::engine::RunStats;
use crate::policy::PolicyName;
use serde::Serialize;
use std::fmt::Write;

/// One policy's row (the `--json` object: exactly the fields).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyReport {
    /// The policy.
    pub policy: PolicyName,
    /// Variance over mean of per-replica concurrency.
    pub var_over_mean: f64,
    /// P(concurrency <= 1).
    pub p_load_le_1: f64,
    /// P(concurrency >= 12).
    pub p_load_ge_12: f64,
    /// Share of requests landing where their prefix is.
    pub affinity: f64,
    /// Session moves per scale event.
    pub moves_per_scale_event: f64,
    /// 99th percentile queueing delay, ms.
    pub p99_queue_delay_ms: f64,
    /// The tails behind the averages (printed, not in the JSON).
    #[serde(skip)]
    pub tails: Tails,
}

/// Tails of load and delay.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Tails {
    /// Mean concurrency.
    pub mean_load: f64,
    /// P(concurrency >= 8), the batch limit.
    pub p_load_ge_8: f64,
    /// 99th and 99.9th percentile and largest concurrency seen.
    pub load_p99: usize,
    /// See `load_p99`.
    pub load_p999: usize,
    /// See `load_p99`.
    pub load_max: usize,
    /// 99.9th percentile and largest queueing delay, ms.
    pub queue_p999_ms: f64,
    /// See `queue_p999_ms`.
    pub queue_max_ms: f64,
    /// Requests completed.
    pub requests: u64,
}

impl PolicyReport {
    /// Summarises one run.
    pub fn from_run(policy: PolicyName, run: &RunStats) -> Self {
        let h = &run.load_histogram;
        let samples = h.iter().sum::<u64>().max(1) as f64;
        let mean = h
            .iter()
            .enumerate()
            .map(|(n, &c)| n as f64 * c as f64)
            .sum::<f64>()
            / samples;
        let var = h
            .iter()
            .enumerate()
            .map(|(n, &c)| (n as f64 - mean).powi(2) * c as f64)
            .sum::<f64>()
            / samples;
        let share = |from: usize, to: usize| {
            h[from.min(h.len())..to.min(h.len())].iter().sum::<u64>() as f64 / samples
        };
        let mut delays = run.queue_delays_s.clone();
        delays.sort_by(f64::total_cmp);
        Self {
            policy,
            var_over_mean: if mean > 0.0 { var / mean } else { 0.0 },
            p_load_le_1: share(0, 2),
            p_load_ge_12: share(12, usize::MAX),
            affinity: run.affinity_hits as f64 / run.affinity_eligible.max(1) as f64,
            moves_per_scale_event: run.moves as f64 / run.scale_events.max(1) as f64,
            p99_queue_delay_ms: 1000.0 * quantile(&delays, 0.99),
            tails: Tails {
                mean_load: mean,
                p_load_ge_8: share(8, usize::MAX),
                load_p99: load_quantile(h, 0.99),
                load_p999: load_quantile(h, 0.999),
                load_max: h.iter().rposition(|&c| c > 0).unwrap_or(0),
                queue_p999_ms: 1000.0 * quantile(&delays, 0.999),
                queue_max_ms: 1000.0 * delays.last().copied().unwrap_or(0.0),
                requests: run.requests,
            },
        }
    }
}

/// The `q` quantile of sorted values (nearest rank); 0 when empty.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The smallest load with at least `q` of the samples at or below it.
fn load_quantile(histogram: &[u64], q: f64) -> usize {
    let total = histogram.iter().sum::<u64>() as f64;
    let mut seen = 0u64;
    for (n, &c) in histogram.iter().enumerate() {
        seen += c;
        if seen as f64 >= q * total {
            return n;
        }
    }
    histogram.len() - 1
}

/// The table, the tails and the targets check, as printed by `kiln route --simulate`.
pub fn render(reports: &[PolicyReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| policy | var/mean | P(load<=1) | P(load>=12) | affinity | moves/scale event | p99 queue delay |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    for r in reports {
        let _ = writeln!(
            out,
            "| {} | {:.3} | {:.2}% | {:.3}% | {:.4} | {:.1} | {:.0} ms |",
            r.policy,
            r.var_over_mean,
            100.0 * r.p_load_le_1,
            100.0 * r.p_load_ge_12,
            r.affinity,
            r.moves_per_scale_event,
            r.p99_queue_delay_ms
        );
    }
    let _ = writeln!(out, "\ntails");
    let _ = writeln!(out, "| policy | mean load | P(load>=8) | load p99 | load p99.9 | load max | queue p99.9 | queue max | requests |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for r in reports {
        let t = &r.tails;
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.3}% | {} | {} | {} | {:.0} ms | {:.0} ms | {} |",
            r.policy,
            t.mean_load,
            100.0 * t.p_load_ge_8,
            t.load_p99,
            t.load_p999,
            t.load_max,
            t.queue_p999_ms,
            t.queue_max_ms,
            t.requests
        );
    }
    if let Some(kiln) = reports.iter().find(|r| r.policy == PolicyName::Kiln) {
        let checks = [
            ("var/mean < 0.5", kiln.var_over_mean < 0.5),
            ("P(load>=12) < 0.05%", kiln.p_load_ge_12 < 0.0005),
            ("affinity >= 0.98", kiln.affinity >= 0.98),
        ];
        let line: Vec<String> = checks
            .iter()
            .map(|(what, ok)| format!("{what}: {}", if *ok { "met" } else { "MISSED" }))
            .collect();
        let _ = writeln!(out, "\nkiln targets: {}", line.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.99), 99.0);
        assert_eq!(quantile(&xs, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn a_poisson_histogram_has_variance_equal_to_its_mean() {
        // Poisson(5) counts scaled to 1e6 samples.
        let mut h = vec![0u64; 40];
        let mut p = (-5.0f64).exp();
        for (n, c) in h.iter_mut().enumerate() {
            *c = (p * 1e6).round() as u64;
            p *= 5.0 / (n + 1) as f64;
        }
        let run = RunStats {
            load_histogram: h,
            queue_delays_s: vec![0.0],
            affinity_eligible: 1,
            affinity_hits: 1,
            moves: 0,
            scale_events: 0,
            requests: 1,
        };
        let r = PolicyReport::from_run(PolicyName::Random, &run);
        assert!((r.var_over_mean - 1.0).abs() < 0.01, "{}", r.var_over_mean);
        // The write-up's figures for uniform hashing at 5 per replica: ~4% and ~0.5%.
        assert!((r.p_load_le_1 - 0.0404).abs() < 0.001, "{}", r.p_load_le_1);
        assert!(
            (r.p_load_ge_12 - 0.0055).abs() < 0.001,
            "{}",
            r.p_load_ge_12
        );
    }
}
