//! The router's placement state: replicas, sessions and their homes, in-flight counts.
//!
//! [`Placer`] applies a [`PolicyName`] to each request and keeps what the decisions need:
//! per replica its health, in-flight requests, scraped metrics and active sessions; per
//! session its home replica, the overflow replicas a thick session spilled onto, and
//! its in-flight requests on each. It does no I/O and reads no clock (times are passed
//! in), so the proxy and the simulator run exactly the same code. Sessions live in a
//! `BTreeMap` so that iteration, and hence every decision, is deterministic.
//!
//! A move is counted whenever a session that has a home gets a different one: its
//! replica was removed or went down (it moves at its next request), the `kiln` policy
//! rebalanced it, or (for `session-hash` and `random`) its hash or draw changed.

use crate::decisions::{least_loaded, needs_split, plan_rebalance, ReplicaLoad};
use crate::hashing::{hash_bytes, rendezvous_pick};
use crate::policy::{KilnParams, PolicyName};
use crate::session::SessionKey;
use kiln_core::rng::Rng;
use std::collections::BTreeMap;

/// Why a request went where it went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlacementKind {
    /// A session's first request.
    New,
    /// A request on its session's home replica.
    Affine,
    /// A thick session's request sent past its home (over the split threshold).
    Split,
    /// A session re-homed because its home was removed, down or excluded (a move).
    Moved,
    /// A request without a session key.
    Unkeyed,
}

impl PlacementKind {
    /// Every kind, in metrics order.
    pub const ALL: [PlacementKind; 5] = [
        PlacementKind::New,
        PlacementKind::Affine,
        PlacementKind::Split,
        PlacementKind::Moved,
        PlacementKind::Unkeyed,
    ];

    /// The metrics label of this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementKind::New => "new",
            PlacementKind::Affine => "affine",
            PlacementKind::Split => "split",
            PlacementKind::Moved => "moved",
            PlacementKind::Unkeyed => "unkeyed",
        }
    }
}

/// Load a replica reports on its /metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scraped {
    /// Running plus queued requests.
    pub requests: f64,
    /// KV cache usage, 0..1.
    pub kv_usage: f64,
}

/// One replica as the placer sees it.
#[derive(Debug, Clone)]
pub struct Replica {
    /// Its base URL (or, in the simulator, its name); also its identity.
    pub name: String,
    /// Hash of `name`.
    pub id: u64,
    /// False after failed checks or connections: it gets no requests.
    pub up: bool,
    /// Requests the router has in flight here.
    pub in_flight: u32,
    /// The latest scrape of its /metrics.
    pub scraped: Scraped,
    /// Sessions homed here that were active within the active window.
    pub sessions: u32,
    /// Requests placed here, by kind (in [`PlacementKind::ALL`] order).
    pub placements: [u64; 5],
    added_ms: u64,
}

/// Where one request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The chosen replica's id.
    pub replica: u64,
    /// Why.
    pub kind: PlacementKind,
}

/// Router-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Sessions given a different home (see the module docs).
    pub moves: u64,
    /// Requests retried on another replica after failing before their first byte.
    pub retries: u64,
    /// Requests that found no healthy replica.
    pub unplaced: u64,
    /// Responses whose replica broke off after the first byte (the client got an error
    /// event instead of the rest).
    pub broken_streams: u64,
}

#[derive(Debug, Clone)]
struct Session {
    home: u64,
    overflow: Vec<u64>,
    in_flight: Vec<(u64, u32)>,
    last_seen_ms: u64,
}

impl Session {
    fn in_flight_on(&self, replica: u64) -> u32 {
        self.in_flight
            .iter()
            .find(|(r, _)| *r == replica)
            .map_or(0, |&(_, n)| n)
    }

    fn is_idle(&self) -> bool {
        self.in_flight.is_empty()
    }
}

/// Placement state and policy (see the module docs).
#[derive(Debug, Clone)]
pub struct Placer {
    policy: PolicyName,
    params: KilnParams,
    replicas: Vec<Replica>,
    sessions: BTreeMap<SessionKey, Session>,
    rng: Rng,
    unkeyed: u64,
    /// Router-wide counters.
    pub counters: Counters,
}

impl Placer {
    /// An empty placer; `seed` drives the `random` policy.
    pub fn new(policy: PolicyName, params: KilnParams, seed: u64) -> Self {
        Self {
            policy,
            params,
            replicas: Vec::new(),
            sessions: BTreeMap::new(),
            rng: Rng::new(seed),
            unkeyed: 0,
            counters: Counters::default(),
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> PolicyName {
        self.policy
    }

    /// The replicas, in the order they were added.
    pub fn replicas(&self) -> &[Replica] {
        &self.replicas
    }

    /// The replica with this id.
    pub fn replica(&self, id: u64) -> Option<&Replica> {
        self.replicas.iter().find(|r| r.id == id)
    }

    /// Sessions the placer remembers.
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// The home replica of a session, if it has one.
    pub fn home_of(&self, key: SessionKey) -> Option<u64> {
        self.sessions.get(&key).map(|s| s.home)
    }

    /// Makes the replica set exactly `names`: new names join (up, young), missing ones
    /// leave. Sessions homed on a leaving replica move at their next request.
    pub fn set_replicas(&mut self, names: &[String], now_ms: u64) {
        self.replicas.retain(|r| names.contains(&r.name));
        for name in names {
            if self.replicas.iter().all(|r| &r.name != name) {
                self.replicas.push(Replica {
                    name: name.clone(),
                    id: hash_bytes(name.as_bytes()),
                    up: true,
                    in_flight: 0,
                    scraped: Scraped::default(),
                    sessions: 0,
                    placements: [0; 5],
                    added_ms: now_ms,
                });
            }
        }
    }

    /// Marks a replica up or down (drained: it gets no requests while down).
    pub fn set_up(&mut self, id: u64, up: bool) {
        if let Some(r) = self.replicas.iter_mut().find(|r| r.id == id) {
            r.up = up;
        }
    }

    /// Records a scrape of a replica's /metrics.
    pub fn set_scraped(&mut self, id: u64, scraped: Scraped) {
        if let Some(r) = self.replicas.iter_mut().find(|r| r.id == id) {
            r.scraped = scraped;
        }
    }

    /// Counts a retry (the proxy retries; the placer keeps the counters).
    pub fn record_retry(&mut self) {
        self.counters.retries += 1;
    }

    /// Counts a response its replica broke off after the first byte.
    pub fn record_broken_stream(&mut self) {
        self.counters.broken_streams += 1;
    }

    /// Places one request of session `key` (none for unkeyed requests), never on
    /// `exclude`, and counts it in flight until [`Placer::finish`]. `None` when no
    /// healthy replica is left.
    pub fn place(
        &mut self,
        key: Option<SessionKey>,
        now_ms: u64,
        exclude: Option<u64>,
    ) -> Option<Placement> {
        let candidates: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].up && Some(self.replicas[i].id) != exclude)
            .collect();
        if candidates.is_empty() {
            self.counters.unplaced += 1;
            return None;
        }
        let placement = match key {
            None => {
                self.unkeyed += 1;
                let pick = self.pick_for_new(&candidates, crate::hashing::mix(self.unkeyed));
                Placement {
                    replica: pick,
                    kind: PlacementKind::Unkeyed,
                }
            }
            Some(key) => self.place_session(key, &candidates, now_ms),
        };
        let replica = self
            .replicas
            .iter_mut()
            .find(|r| r.id == placement.replica)
            .expect("a candidate");
        replica.in_flight += 1;
        let kind_index = PlacementKind::ALL
            .iter()
            .position(|&k| k == placement.kind)
            .expect("listed");
        replica.placements[kind_index] += 1;
        Some(placement)
    }

    /// Ends a request placed on `replica` for session `key`.
    pub fn finish(&mut self, key: Option<SessionKey>, replica: u64) {
        if let Some(r) = self.replicas.iter_mut().find(|r| r.id == replica) {
            r.in_flight = r.in_flight.saturating_sub(1);
        }
        let Some(session) = key.and_then(|k| self.sessions.get_mut(&k)) else {
            return;
        };
        if let Some(pos) = session.in_flight.iter().position(|(r, _)| *r == replica) {
            session.in_flight[pos].1 -= 1;
            if session.in_flight[pos].1 == 0 {
                session.in_flight.swap_remove(pos);
            }
        }
    }

    /// Periodic upkeep at `now_ms`: forgets long-idle sessions, recounts active sessions
    /// per replica and, under the `kiln` policy, rebalances idle sessions past the
    /// imbalance threshold.
    pub fn tick(&mut self, now_ms: u64) {
        let p = self.params;
        self.sessions.retain(|_, s| {
            !s.is_idle() || now_ms.saturating_sub(s.last_seen_ms) < p.forget_after_ms
        });
        self.recount_sessions(now_ms);
        if self.policy == PolicyName::Kiln {
            self.rebalance(now_ms);
        }
    }

    fn place_session(&mut self, key: SessionKey, candidates: &[usize], now_ms: u64) -> Placement {
        let previous = self.sessions.get(&key).map(|s| s.home);
        let home_alive =
            previous.is_some_and(|h| candidates.iter().any(|&i| self.replicas[i].id == h));
        let (home, mut kind) = match (self.policy, previous) {
            (PolicyName::Random, _) => (
                self.replicas[candidates[self.rng.below(candidates.len())]].id,
                None,
            ),
            (PolicyName::SessionHash, _) => {
                let ids = candidates.iter().map(|&i| self.replicas[i].id);
                (
                    self.replicas[candidates[rendezvous_pick(key.0, ids).expect("non-empty")]].id,
                    None,
                )
            }
            (PolicyName::Kiln, Some(home)) if home_alive => (home, Some(PlacementKind::Affine)),
            (PolicyName::Kiln, _) => (self.pick_for_new(candidates, key.0), None),
        };
        let kind = kind.get_or_insert(match previous {
            None => PlacementKind::New,
            Some(h) if h == home => PlacementKind::Affine,
            Some(_) => PlacementKind::Moved,
        });
        if *kind == PlacementKind::Moved {
            self.counters.moves += 1;
        }
        let session = self.sessions.entry(key).or_insert_with(|| Session {
            home,
            overflow: Vec::new(),
            in_flight: Vec::new(),
            last_seen_ms: now_ms,
        });
        if session.home != home {
            session.overflow.retain(|&r| r != home);
        }
        session.home = home;
        session.last_seen_ms = now_ms;
        let target = if self.policy == PolicyName::Kiln
            && needs_split(session.in_flight_on(home), self.params.split_threshold)
        {
            *kind = PlacementKind::Split;
            self.overflow_target(key, candidates)
        } else {
            home
        };
        let session = self.sessions.get_mut(&key).expect("inserted");
        match session.in_flight.iter_mut().find(|(r, _)| *r == target) {
            Some((_, n)) => *n += 1,
            None => session.in_flight.push((target, 1)),
        }
        if matches!(*kind, PlacementKind::New | PlacementKind::Moved) {
            self.shift_session(previous, home);
        }
        Placement {
            replica: target,
            kind: *kind,
        }
    }

    /// A thick session's overflow replica: one it spilled onto before that is below the
    /// threshold, else the least-loaded replica it is not saturating (remembered).
    fn overflow_target(&mut self, key: SessionKey, candidates: &[usize]) -> u64 {
        let threshold = self.params.split_threshold;
        let session = &self.sessions[&key];
        let usable = |id: u64| candidates.iter().any(|&i| self.replicas[i].id == id);
        if let Some(&r) = session
            .overflow
            .iter()
            .find(|&&r| usable(r) && !needs_split(session.in_flight_on(r), threshold))
        {
            return r;
        }
        let open: Vec<usize> = candidates
            .iter()
            .copied()
            .filter(|&i| {
                let id = self.replicas[i].id;
                id != session.home && !needs_split(session.in_flight_on(id), threshold)
            })
            .collect();
        // Every replica saturated by this session: the least loaded takes it anyway.
        let pool = if open.is_empty() { candidates } else { &open };
        let target = self.pick_for_new(pool, key.0);
        let session = self.sessions.get_mut(&key).expect("present");
        if target != session.home && !session.overflow.contains(&target) {
            session.overflow.push(target);
        }
        target
    }

    fn pick_for_new(&self, candidates: &[usize], key: u64) -> u64 {
        let loads: Vec<ReplicaLoad> = candidates.iter().map(|&i| self.load_of(i)).collect();
        loads[least_loaded(&loads, key, &self.params).expect("non-empty")].id
    }

    fn load_of(&self, i: usize) -> ReplicaLoad {
        let r = &self.replicas[i];
        ReplicaLoad {
            id: r.id,
            sessions: r.sessions,
            in_flight: r.in_flight,
            scraped_requests: r.scraped.requests,
            kv_usage: r.scraped.kv_usage,
        }
    }

    /// Keeps active-session counts current between ticks when a session changes home.
    fn shift_session(&mut self, from: Option<u64>, to: u64) {
        for r in &mut self.replicas {
            if Some(r.id) == from {
                r.sessions = r.sessions.saturating_sub(1);
            }
            if r.id == to {
                r.sessions += 1;
            }
        }
    }

    fn recount_sessions(&mut self, now_ms: u64) {
        for r in &mut self.replicas {
            r.sessions = 0;
        }
        for s in self.sessions.values() {
            if now_ms.saturating_sub(s.last_seen_ms) < self.params.active_window_ms || !s.is_idle()
            {
                if let Some(r) = self.replicas.iter_mut().find(|r| r.id == s.home) {
                    r.sessions += 1;
                }
            }
        }
    }

    /// Moves the fewest idle sessions that bring load back within the threshold,
    /// longest-idle first (their cache is the likeliest to be gone anyway).
    fn rebalance(&mut self, now_ms: u64) {
        let up: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].up)
            .collect();
        let counts: Vec<u32> = up.iter().map(|&i| self.replicas[i].sessions).collect();
        let settled: Vec<bool> = up
            .iter()
            .map(|&i| {
                now_ms.saturating_sub(self.replicas[i].added_ms) >= self.params.new_replica_grace_ms
            })
            .collect();
        for (from, to) in plan_rebalance(&counts, &settled, self.params.imbalance_threshold) {
            let (from_id, to_id) = (self.replicas[up[from]].id, self.replicas[up[to]].id);
            let window = self.params.active_window_ms;
            let victim = self
                .sessions
                .iter()
                .filter(|(_, s)| {
                    s.home == from_id
                        && s.is_idle()
                        && now_ms.saturating_sub(s.last_seen_ms) < window
                })
                .min_by_key(|(k, s)| (s.last_seen_ms, **k))
                .map(|(k, _)| *k);
            let Some(victim) = victim else { continue };
            let session = self.sessions.get_mut(&victim).expect("present");
            session.home = to_id;
            session.overflow.retain(|&r| r != to_id);
            self.replicas[up[from]].sessions -= 1;
            self.replicas[up[to]].sessions += 1;
            self.counters.moves += 1;
        }
    }
}
