//! The placement decisions of the `kiln` policy as small pure functions.
//!
//! Each takes plain numbers (a snapshot of load) and returns a choice, so each is unit
//! tested on its own and shared by the proxy and the simulator through
//! [`crate::placer::Placer`]. Load of a replica, in "sessions": its active sessions,
//! plus its in-flight requests (the larger of the router's own count and the running
//! plus queued requests its /metrics reports, which also sees other routers' traffic),
//! plus `kv_weight` times its KV usage. Ties go to the rendezvous winner of the session
//! key, so equal replicas still split sessions evenly and deterministically.

use crate::hashing::rendezvous_weight;
use crate::policy::KilnParams;

/// What placement knows about one replica.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaLoad {
    /// Hash of the replica's name (its stable identity).
    pub id: u64,
    /// Sessions homed here that were active within the active window.
    pub sessions: u32,
    /// Requests the router has in flight here.
    pub in_flight: u32,
    /// Running plus queued requests from the replica's /metrics.
    pub scraped_requests: f64,
    /// KV cache usage from the replica's /metrics, 0..1.
    pub kv_usage: f64,
}

/// A replica's load score in sessions (lower is emptier).
pub fn load_score(load: &ReplicaLoad, params: &KilnParams) -> f64 {
    let requests = f64::from(load.in_flight).max(load.scraped_requests);
    f64::from(load.sessions) + requests + params.kv_weight * load.kv_usage.clamp(0.0, 1.0)
}

/// Position of the least-loaded replica in `candidates` for session `key`.
pub fn least_loaded(candidates: &[ReplicaLoad], key: u64, params: &KilnParams) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .min_by(|(_, a), (_, b)| {
            load_score(a, params)
                .total_cmp(&load_score(b, params))
                .then_with(|| rendezvous_weight(key, b.id).cmp(&rendezvous_weight(key, a.id)))
        })
        .map(|(i, _)| i)
}

/// Whether a session's next request must go elsewhere, given how many of its requests
/// are already in flight on its replica.
pub fn needs_split(session_in_flight_here: u32, split_threshold: u32) -> bool {
    session_in_flight_here >= split_threshold.max(1)
}

/// The fewest one-session moves `(from, to)` that bring the busiest replica within
/// `threshold` active sessions of the least busy settled one.
///
/// `sessions[i]` is replica i's active session count and `settled[i]` says it is past
/// its grace period: a young replica is a destination but never the trigger, so a
/// scale-up moves nothing by itself. Each move goes from the busiest replica to the
/// least busy one (young or settled).
pub fn plan_rebalance(sessions: &[u32], settled: &[bool], threshold: u32) -> Vec<(usize, usize)> {
    let mut counts = sessions.to_vec();
    let mut moves = Vec::new();
    // Every move lowers the sum of squares, so this ends; the bound is a backstop.
    for _ in 0..counts.iter().sum::<u32>() {
        let busiest = argmax(&counts);
        let floor = (0..counts.len())
            .filter(|&i| settled[i])
            .map(|i| counts[i])
            .min();
        let (Some(from), Some(floor)) = (busiest, floor) else {
            break;
        };
        let to = argmin(&counts).expect("non-empty");
        if counts[from] <= floor + threshold || counts[from] <= counts[to] + 1 {
            break;
        }
        counts[from] -= 1;
        counts[to] += 1;
        moves.push((from, to));
    }
    moves
}

fn argmax(xs: &[u32]) -> Option<usize> {
    // First of equals, so plans are deterministic.
    xs.iter()
        .enumerate()
        .rev()
        .max_by_key(|&(_, &x)| x)
        .map(|(i, _)| i)
}

fn argmin(xs: &[u32]) -> Option<usize> {
    xs.iter()
        .enumerate()
        .min_by_key(|&(_, &x)| x)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(id: u64, sessions: u32, in_flight: u32, kv_usage: f64) -> ReplicaLoad {
        ReplicaLoad {
            id,
            sessions,
            in_flight,
            scraped_requests: 0.0,
            kv_usage,
        }
    }

    #[test]
    fn a_new_session_goes_to_the_replica_with_fewest_sessions_and_requests() {
        let p = KilnParams::default();
        let replicas = [load(1, 5, 4, 0.0), load(2, 3, 2, 0.0), load(3, 4, 4, 0.0)];
        assert_eq!(least_loaded(&replicas, 42, &p), Some(1));
    }

    #[test]
    fn a_full_kv_cache_counts_against_a_replica() {
        let p = KilnParams::default();
        let replicas = [load(1, 3, 3, 1.0), load(2, 4, 3, 0.0)];
        assert_eq!(least_loaded(&replicas, 42, &p), Some(1));
    }

    #[test]
    fn scraped_requests_count_when_they_exceed_the_routers_own() {
        let p = KilnParams::default();
        let mut busy = load(1, 2, 0, 0.0);
        busy.scraped_requests = 6.0;
        let replicas = [busy, load(2, 3, 1, 0.0)];
        assert_eq!(least_loaded(&replicas, 42, &p), Some(1));
    }

    #[test]
    fn ties_split_new_sessions_evenly_between_equal_replicas() {
        let p = KilnParams::default();
        let replicas = [load(11, 0, 0, 0.0), load(22, 0, 0, 0.0)];
        let first = (0..1000u64)
            .filter(|&k| least_loaded(&replicas, crate::hashing::mix(k), &p) == Some(0))
            .count();
        assert!((400..600).contains(&first), "{first}");
    }

    #[test]
    fn no_candidates_means_no_placement() {
        assert_eq!(least_loaded(&[], 1, &KilnParams::default()), None);
    }

    #[test]
    fn a_session_splits_only_at_the_threshold() {
        assert!(!needs_split(3, 4));
        assert!(needs_split(4, 4));
        assert!(
            needs_split(1, 0),
            "a zero threshold still allows one request"
        );
    }

    #[test]
    fn balanced_replicas_move_nothing() {
        assert!(plan_rebalance(&[5, 6, 4, 5], &[true; 4], 4).is_empty());
    }

    #[test]
    fn a_scale_up_moves_nothing_while_the_new_replica_is_young() {
        assert!(plan_rebalance(&[5, 5, 5, 0], &[true, true, true, false], 4).is_empty());
    }

    #[test]
    fn an_overloaded_replica_sheds_just_enough_sessions() {
        // 11 vs a floor of 5: two moves bring it to 9, within 4 of the floor.
        let moves = plan_rebalance(&[11, 5, 6, 5], &[true; 4], 4);
        assert_eq!(moves, vec![(0, 1), (0, 3)]);
    }

    #[test]
    fn shed_sessions_go_to_a_young_replica_first() {
        let moves = plan_rebalance(&[10, 5, 0], &[true, true, false], 4);
        assert_eq!(moves, vec![(0, 2)]);
    }

    #[test]
    fn a_settled_empty_replica_pulls_sessions_over() {
        let moves = plan_rebalance(&[6, 6, 0], &[true; 3], 4);
        assert_eq!(moves.len(), 2);
        assert!(moves.iter().all(|&(_, to)| to == 2));
    }
}
