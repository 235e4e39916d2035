//! `kiln route --simulate`: every policy on the same seeded scenario, in process.
//!
//! The scenario: `replicas` replicas with `sessions_per_replica` closed-loop agent
//! sessions each, drawn from the benchmark's seeded generator (`kiln-workload`: shared
//! system prompt, heavy-tailed inputs and outputs, tool and user think times,
//! tree-shaped sessions); a session that ends is replaced, so the population tracks the
//! target;
//! scale events add or remove replicas (and scale the session target with them, as an
//! autoscaler would); tree-shaped sessions fan out into concurrent requests. Replicas
//! follow [`service`]'s model and the router is the real [`crate::placer::Placer`].
//! One [`PolicyReport`] per policy; [`report`] prints the table and writes the JSON.

pub mod engine;
pub mod report;
pub mod service;

use crate::policy::{KilnParams, PolicyName};
use crate::RouterError;
use kiln_workload::params::WorkloadParams;
use kiln_workload::session::SessionGenerator;
pub use report::{PolicyReport, Tails};
use service::ServiceParams;

/// A change in the number of replicas at a point in time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleEvent {
    /// Seconds from the start.
    pub at_s: f64,
    /// Replicas added (positive) or removed (negative).
    pub replicas: i32,
}

/// Everything a simulated run depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Replicas at the start.
    pub replicas: usize,
    /// Target sessions per replica.
    pub sessions_per_replica: usize,
    /// Seed of the workload and of the simulation's own draws.
    pub seed: u64,
    /// Simulated seconds in all.
    pub duration_s: f64,
    /// Seconds before measurement starts (sessions start and settle).
    pub warmup_s: f64,
    /// New sessions (at the start and after a scale-up) start over this many seconds.
    pub ramp_s: f64,
    /// Mean seconds between a session's end and its replacement's start (exponential).
    pub new_session_gap_s: f64,
    /// Seconds between scrapes, upkeep and load samples.
    pub tick_s: f64,
    /// Scale events in time order.
    pub scale_events: Vec<ScaleEvent>,
    /// Replica speeds.
    pub service: ServiceParams,
    /// KV tokens a replica holds (HBM plus host tier) for the KV-usage signal.
    pub kv_capacity_tokens: u64,
    /// The sessions (the benchmark's parameters).
    pub workload: WorkloadParams,
    /// The `kiln` policy's tunables.
    pub kiln: KilnParams,
}

impl SimConfig {
    /// The scenario at `replicas` x `sessions_per_replica`: 85 simulated
    /// minutes, 15 of warm-up, scale-ups of 10% at minutes 25 and 65 and a scale-down of
    /// 10% at minute 45. Replicas prefill 12k uncached tokens/s and decode 60 tokens/s
    /// per request (a ~100k-token miss costs ~8 s, like a ~500-token answer), run up to
    /// 8 requests at once and slow by 8% per extra running request. Sessions are the
    /// benchmark's defaults (15% tree-shaped, a quarter of their turns fanning out into
    /// 2 to 4 concurrent requests).
    pub fn scenario(replicas: usize, sessions_per_replica: usize, seed: u64) -> Self {
        let step = (replicas as i32 / 10).max(1);
        Self {
            replicas,
            sessions_per_replica,
            seed,
            duration_s: 85.0 * 60.0,
            warmup_s: 15.0 * 60.0,
            ramp_s: 60.0,
            new_session_gap_s: 1.0,
            tick_s: 1.0,
            scale_events: vec![
                ScaleEvent {
                    at_s: 25.0 * 60.0,
                    replicas: step,
                },
                ScaleEvent {
                    at_s: 45.0 * 60.0,
                    replicas: -step,
                },
                ScaleEvent {
                    at_s: 65.0 * 60.0,
                    replicas: step,
                },
            ],
            service: ServiceParams {
                prefill_tokens_per_s: 12_000.0,
                decode_tokens_per_s: 60.0,
                slowdown: 0.08,
                max_running: 8,
            },
            kv_capacity_tokens: 1_000_000,
            workload: WorkloadParams::default(),
            kiln: KilnParams::default(),
        }
    }
}

/// Runs every policy on `config` and reports each (an error if the workload parameters
/// are invalid).
pub fn simulate(config: &SimConfig) -> Result<Vec<PolicyReport>, RouterError> {
    let source = SessionGenerator::new(config.workload.clone(), config.seed)?;
    Ok(PolicyName::ALL
        .iter()
        .map(|&policy| PolicyReport::from_run(policy, &engine::run(config, policy, &source)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        let mut config = SimConfig::scenario(10, 5, 3);
        config.duration_s = 30.0 * 60.0;
        config.warmup_s = 5.0 * 60.0;
        config.scale_events = vec![
            ScaleEvent {
                at_s: 10.0 * 60.0,
                replicas: 2,
            },
            ScaleEvent {
                at_s: 20.0 * 60.0,
                replicas: -2,
            },
        ];
        config
    }

    #[test]
    fn a_seed_gives_one_history() {
        let config = small();
        assert_eq!(simulate(&config).unwrap(), simulate(&config).unwrap());
    }

    #[test]
    fn session_affinity_policies_keep_requests_on_their_prefix() {
        let reports = simulate(&small()).unwrap();
        let by = |p: PolicyName| reports.iter().find(|r| r.policy == p).unwrap().clone();
        assert!(by(PolicyName::Random).affinity < 0.5);
        assert!(by(PolicyName::SessionHash).affinity > 0.95);
        assert!(by(PolicyName::Kiln).affinity > 0.95);
    }

    #[test]
    fn the_kiln_policy_balances_load_better_than_hashing() {
        let reports = simulate(&small()).unwrap();
        let by = |p: PolicyName| reports.iter().find(|r| r.policy == p).unwrap().clone();
        assert!(by(PolicyName::Kiln).var_over_mean < by(PolicyName::SessionHash).var_over_mean);
    }
}
