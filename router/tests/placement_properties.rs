//! Property tests of placement over replica-set changes, for every policy that keeps
//! sessions on a home replica: one replica takes everything; adding a replica moves at
//! most what the policy says; removing one moves only its sessions.

use kiln_router::placer::Placer;
use kiln_router::policy::{KilnParams, PolicyName};
use kiln_router::session::SessionKey;
use proptest::prelude::*;

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("http://10.0.0.{i}:8000")).collect()
}

/// Places one request per session and finishes it; returns each session's replica.
fn round(placer: &mut Placer, sessions: &[u64], now_ms: u64) -> Vec<u64> {
    sessions
        .iter()
        .map(|&s| {
            let p = placer
                .place(Some(SessionKey(s)), now_ms, None)
                .expect("a replica");
            placer.finish(Some(SessionKey(s)), p.replica);
            p.replica
        })
        .collect()
}

fn policy() -> impl Strategy<Value = PolicyName> {
    prop::sample::select(PolicyName::ALL.to_vec())
}

fn affine_policy() -> impl Strategy<Value = PolicyName> {
    prop::sample::select(vec![PolicyName::SessionHash, PolicyName::Kiln])
}

proptest! {
    #[test]
    fn with_one_replica_everything_goes_there(policy in policy(), sessions in prop::collection::vec(any::<u64>(), 1..50), seed in any::<u64>()) {
        let mut placer = Placer::new(policy, KilnParams::default(), seed);
        placer.set_replicas(&names(1), 0);
        let only = placer.replicas()[0].id;
        for now in [0, 1000] {
            prop_assert!(round(&mut placer, &sessions, now).iter().all(|&r| r == only));
        }
        let unkeyed = placer.place(None, 2000, None).expect("a replica");
        prop_assert_eq!(unkeyed.replica, only);
    }

    #[test]
    fn adding_a_replica_moves_sessions_only_onto_it_under_session_hash(n in 1usize..8, sessions in prop::collection::btree_set(any::<u64>(), 1..80)) {
        let sessions: Vec<u64> = sessions.into_iter().collect();
        let mut placer = Placer::new(PolicyName::SessionHash, KilnParams::default(), 1);
        placer.set_replicas(&names(n), 0);
        let before = round(&mut placer, &sessions, 0);
        placer.set_replicas(&names(n + 1), 10);
        let added = placer.replicas()[n].id;
        let after = round(&mut placer, &sessions, 20);
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count() as u64;
        prop_assert!(before.iter().zip(&after).all(|(b, a)| b == a || *a == added));
        prop_assert_eq!(placer.counters.moves, moved);
    }

    #[test]
    fn adding_a_replica_moves_no_kiln_session_while_new_sessions_fill_it(n in 1usize..8, sessions in prop::collection::btree_set(any::<u64>(), 1..80)) {
        let sessions: Vec<u64> = sessions.into_iter().collect();
        let params = KilnParams::default();
        let mut placer = Placer::new(PolicyName::Kiln, params, 1);
        placer.set_replicas(&names(n), 0);
        let before = round(&mut placer, &sessions, 0);
        placer.set_replicas(&names(n + 1), 10);
        placer.tick(20);
        let after = round(&mut placer, &sessions, 30);
        prop_assert_eq!(&before, &after);
        prop_assert_eq!(placer.counters.moves, 0);
        // A new session takes an emptiest replica: the new one or one as empty.
        let emptiest = placer.replicas().iter().map(|r| r.sessions).min();
        let newcomer = placer.place(Some(SessionKey(u64::MAX)), 40, None).expect("a replica");
        let chosen = placer.replicas().iter().find(|r| r.id == newcomer.replica).expect("known");
        prop_assert!(sessions.contains(&u64::MAX) || Some(chosen.sessions - 1) == emptiest);
    }

    #[test]
    fn after_its_grace_period_a_new_replica_pulls_over_only_the_excess(n in 1usize..8, sessions in prop::collection::btree_set(any::<u64>(), 1..80)) {
        let sessions: Vec<u64> = sessions.into_iter().collect();
        let params = KilnParams::default();
        let mut placer = Placer::new(PolicyName::Kiln, params, 1);
        placer.set_replicas(&names(n), 0);
        let before = round(&mut placer, &sessions, 0);
        placer.set_replicas(&names(n + 1), 10);
        let settled = 10 + params.new_replica_grace_ms;
        placer.tick(settled);
        let after = round(&mut placer, &sessions, settled + 1);
        let added = placer.replicas()[n].id;
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
        prop_assert!(before.iter().zip(&after).all(|(b, a)| b == a || *a == added));
        // The busiest replica ends within the threshold of the new one's count.
        let busiest = (0..n).map(|i| placer.replicas()[i].sessions).max().unwrap_or(0);
        prop_assert!(busiest <= moved as u32 + params.imbalance_threshold);
        prop_assert_eq!(placer.counters.moves, moved as u64);
    }

    #[test]
    fn removing_a_replica_moves_only_its_sessions(policy in affine_policy(), n in 2usize..8, gone in 0usize..8, sessions in prop::collection::btree_set(any::<u64>(), 1..80)) {
        let sessions: Vec<u64> = sessions.into_iter().collect();
        let gone = gone % n;
        let mut placer = Placer::new(policy, KilnParams::default(), 1);
        let all = names(n);
        placer.set_replicas(&all, 0);
        let before = round(&mut placer, &sessions, 0);
        let gone_id = placer.replicas()[gone].id;
        let rest: Vec<String> = all.iter().enumerate().filter(|&(i, _)| i != gone).map(|(_, s)| s.clone()).collect();
        placer.set_replicas(&rest, 10);
        let after = round(&mut placer, &sessions, 20);
        for (b, a) in before.iter().zip(&after) {
            prop_assert!(*a != gone_id);
            prop_assert!(b == a || *b == gone_id, "a session off the removed replica moved");
        }
        let on_gone = before.iter().filter(|&&b| b == gone_id).count() as u64;
        prop_assert_eq!(placer.counters.moves, on_gone);
    }

    #[test]
    fn a_drained_replica_gets_nothing_until_it_is_back(policy in policy(), n in 2usize..8, sessions in prop::collection::vec(any::<u64>(), 1..50)) {
        let mut placer = Placer::new(policy, KilnParams::default(), 3);
        placer.set_replicas(&names(n), 0);
        let down = placer.replicas()[0].id;
        placer.set_up(down, false);
        prop_assert!(round(&mut placer, &sessions, 0).iter().all(|&r| r != down));
        placer.set_up(down, true);
        prop_assert!(placer.place(None, 1, Some(placer.replicas()[1].id)).is_some());
    }
}
