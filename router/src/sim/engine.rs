//! The discrete-event loop of one simulated run under one policy.
//!
//! Events (session starts, turns, request completions, one-second ticks, scale events)
//! are processed in time order, ties in scheduling order, so a seed gives one history.
//! Each tick the router scrapes every replica (running plus queued requests, KV usage)
//! and runs its upkeep, exactly as the proxy's health loop does; after warm-up each tick
//! also samples every replica's concurrency (running plus queued requests).
//!
//! Cache model: every replica holds the shared system prompt; a replica that served a
//! session holds its history up to what it served (the main line including output; a
//! fan-out branch's shared history), and nothing is evicted. A request's uncached tokens
//! are its input minus the prefix its replica holds; it "lands where its prefix is"
//! (counts towards affinity) when that replica holds the session's whole history before
//! this turn's new input.

use super::service::Service;
use super::SimConfig;
use crate::placer::{Placer, Scraped};
use crate::policy::PolicyName;
use crate::session::{session_key, SessionKey};
use kiln_core::rng::Rng;
use kiln_workload::session::{Session, SessionGenerator};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// What one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RunStats {
    /// `load_histogram[n]`: replica-ticks with `n` requests running or queued (the last
    /// bucket gathers everything above).
    pub load_histogram: Vec<u64>,
    /// Queueing delay of every request that arrived after warm-up, in seconds.
    pub queue_delays_s: Vec<f64>,
    /// Requests after warm-up past their session's first turn, and those among them that
    /// landed on a replica that served their session before.
    pub affinity_eligible: u64,
    /// See `affinity_eligible`.
    pub affinity_hits: u64,
    /// Session moves from the first scale event on, and the number of scale events.
    pub moves: u64,
    /// See `moves`.
    pub scale_events: usize,
    /// Requests completed over the whole run.
    pub requests: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    StartSession,
    Turn(u64),
    Finish(usize, u64),
    Tick,
    Scale(usize),
}

struct SimReplica {
    name: String,
    id: u64,
    in_set: bool,
    service: Service<u64>,
    version: u64,
}

struct Live {
    key: SessionKey,
    plan: Session,
    turn: usize,
    outstanding: usize,
    cached: Vec<(usize, u64)>,
}

struct InFlight {
    session: u64,
    replica: usize,
    after_warmup: bool,
}

struct Sim<'a> {
    config: &'a SimConfig,
    source: &'a SessionGenerator,
    placer: Placer,
    rng: Rng,
    now: f64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, Event)>>,
    replicas: Vec<SimReplica>,
    by_id: HashMap<u64, usize>,
    sessions: HashMap<u64, Live>,
    next_session: u64,
    target_sessions: usize,
    requests: HashMap<u64, InFlight>,
    next_request: u64,
    stats: RunStats,
    moves_at_first_event: Option<u64>,
}

/// Runs the configured scenario under `policy` with sessions from `source`.
pub fn run(config: &SimConfig, policy: PolicyName, source: &SessionGenerator) -> RunStats {
    let mut sim = Sim {
        config,
        source,
        placer: Placer::new(policy, config.kiln, config.seed ^ 0x5eed),
        rng: Rng::new(config.seed),
        now: 0.0,
        seq: 0,
        queue: BinaryHeap::new(),
        replicas: Vec::new(),
        by_id: HashMap::new(),
        sessions: HashMap::new(),
        next_session: 0,
        target_sessions: config.replicas * config.sessions_per_replica,
        requests: HashMap::new(),
        next_request: 0,
        stats: RunStats {
            load_histogram: vec![0; 65],
            queue_delays_s: Vec::new(),
            affinity_eligible: 0,
            affinity_hits: 0,
            moves: 0,
            scale_events: config.scale_events.len(),
            requests: 0,
        },
        moves_at_first_event: None,
    };
    sim.add_replicas(config.replicas);
    for _ in 0..sim.target_sessions {
        let at = sim.rng.uniform() * config.ramp_s;
        sim.schedule(at, Event::StartSession);
    }
    sim.schedule(config.tick_s, Event::Tick);
    for (i, event) in config.scale_events.iter().enumerate() {
        sim.schedule(event.at_s, Event::Scale(i));
    }
    while let Some(Reverse((t, _, event))) = sim.queue.pop() {
        sim.now = t as f64 * 1e-6;
        if sim.now > config.duration_s {
            break;
        }
        sim.handle(event);
    }
    let first = sim
        .moves_at_first_event
        .unwrap_or(sim.placer.counters.moves);
    sim.stats.moves = sim.placer.counters.moves - first;
    sim.stats
}

impl Sim<'_> {
    fn schedule(&mut self, at_s: f64, event: Event) {
        self.seq += 1;
        // Rounded up to the microsecond, so a completion never fires before its time.
        self.queue
            .push(Reverse(((at_s * 1e6).ceil() as u64, self.seq, event)));
    }

    fn now_ms(&self) -> u64 {
        (self.now * 1000.0) as u64
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::StartSession => self.start_session(),
            Event::Turn(s) => self.send_turn(s),
            Event::Finish(r, version) if version == self.replicas[r].version => self.finish(r),
            Event::Finish(..) => {}
            Event::Tick => self.tick(),
            Event::Scale(i) => self.scale(i),
        }
    }

    fn add_replicas(&mut self, n: usize) {
        for _ in 0..n {
            let name = format!("replica-{}", self.replicas.len());
            let id = crate::hashing::hash_bytes(name.as_bytes());
            self.by_id.insert(id, self.replicas.len());
            self.replicas.push(SimReplica {
                name,
                id,
                in_set: true,
                service: Service::new(self.config.service),
                version: 0,
            });
        }
        self.publish_replicas();
    }

    fn publish_replicas(&mut self) {
        let names: Vec<String> = self
            .replicas
            .iter()
            .filter(|r| r.in_set)
            .map(|r| r.name.clone())
            .collect();
        let now_ms = self.now_ms();
        self.placer.set_replicas(&names, now_ms);
    }

    fn start_session(&mut self) {
        if self.sessions.len() >= self.target_sessions {
            return;
        }
        let index = self.next_session;
        self.next_session += 1;
        let plan = self.source.session(index);
        // The key the proxy derives from the benchmark's `x-session-id` header.
        let key = session_key(Some(&plan.id()), b"").expect("a header always gives a key");
        self.sessions.insert(
            index,
            Live {
                key,
                plan,
                turn: 0,
                outstanding: 0,
                cached: Vec::new(),
            },
        );
        self.send_turn(index);
    }

    fn send_turn(&mut self, s: u64) {
        let after_warmup = self.now >= self.config.warmup_s;
        let now_ms = self.now_ms();
        let live = self.sessions.get_mut(&s).expect("live session");
        let turn = live.turn;
        let history = live.plan.history_len(turn);
        let next_history = live.plan.history_len(turn + 1);
        let system = u64::from(live.plan.system_prompt_tokens);
        let requests = live.plan.turns[turn].requests.clone();
        live.outstanding = requests.len();
        for (branch, request) in requests.iter().enumerate() {
            let live = self.sessions.get_mut(&s).expect("live session");
            let placement = self
                .placer
                .place(Some(live.key), now_ms, None)
                .expect("replicas are never all removed");
            let r = self.by_id[&placement.replica];
            let held = live.cached.iter().find(|(c, _)| *c == r).map(|&(_, n)| n);
            if turn > 0 && after_warmup {
                self.stats.affinity_eligible += 1;
                self.stats.affinity_hits += u64::from(held.is_some_and(|n| n >= history));
            }
            let input = history + u64::from(request.new_input);
            let cached = held.unwrap_or(0).min(history).max(system);
            let writes = if branch == 0 { next_history } else { history };
            match live.cached.iter_mut().find(|(c, _)| *c == r) {
                Some((_, n)) => *n = (*n).max(writes),
                None => live.cached.push((r, writes)),
            }
            let work = self.config.service.work_s(input - cached, request.output);
            let id = self.next_request;
            self.next_request += 1;
            self.requests.insert(
                id,
                InFlight {
                    session: s,
                    replica: r,
                    after_warmup,
                },
            );
            if let Some(delay) = self.replicas[r].service.arrive(id, work, self.now) {
                if after_warmup {
                    self.stats.queue_delays_s.push(delay);
                }
            }
            self.reschedule(r);
        }
    }

    fn reschedule(&mut self, r: usize) {
        let replica = &mut self.replicas[r];
        replica.version += 1;
        if let Some(at) = replica.service.next_finish() {
            let event = Event::Finish(r, replica.version);
            self.schedule(at, event);
        }
    }

    fn finish(&mut self, r: usize) {
        let (done, started) = self.replicas[r].service.complete(self.now);
        for (id, delay) in started {
            if self.requests[&id].after_warmup {
                self.stats.queue_delays_s.push(delay);
            }
        }
        for id in done {
            let request = self.requests.remove(&id).expect("in flight");
            self.stats.requests += 1;
            let live = self
                .sessions
                .get_mut(&request.session)
                .expect("live session");
            self.placer
                .finish(Some(live.key), self.replicas[request.replica].id);
            live.outstanding -= 1;
            if live.outstanding > 0 {
                continue;
            }
            live.turn += 1;
            if live.turn < live.plan.turns.len() {
                let at = self.now + live.plan.turns[live.turn].think_s;
                self.schedule(at, Event::Turn(request.session));
            } else {
                self.sessions.remove(&request.session);
                let at = self.now - self.config.new_session_gap_s * (1.0 - self.rng.uniform()).ln();
                self.schedule(at, Event::StartSession);
            }
        }
        self.reschedule(r);
    }

    fn tick(&mut self) {
        let mut kv_tokens = vec![0u64; self.replicas.len()];
        for live in self.sessions.values() {
            for &(r, n) in &live.cached {
                kv_tokens[r] += n;
            }
        }
        for (r, replica) in self.replicas.iter().enumerate().filter(|(_, r)| r.in_set) {
            let kv_usage = (kv_tokens[r] as f64 / self.config.kv_capacity_tokens as f64).min(1.0);
            let scraped = Scraped {
                requests: replica.service.load() as f64,
                kv_usage,
            };
            self.placer.set_scraped(replica.id, scraped);
        }
        let now_ms = self.now_ms();
        self.placer.tick(now_ms);
        if self.now >= self.config.warmup_s {
            let last = self.stats.load_histogram.len() - 1;
            for replica in self.replicas.iter().filter(|r| r.in_set) {
                self.stats.load_histogram[replica.service.load().min(last)] += 1;
            }
        }
        self.schedule(self.now + self.config.tick_s, Event::Tick);
    }

    fn scale(&mut self, i: usize) {
        self.moves_at_first_event
            .get_or_insert(self.placer.counters.moves);
        let delta = self.config.scale_events[i].replicas;
        let sessions = delta.unsigned_abs() as usize * self.config.sessions_per_replica;
        if delta > 0 {
            self.add_replicas(delta as usize);
            self.target_sessions += sessions;
            for _ in 0..sessions {
                let at = self.now + self.rng.uniform() * self.config.ramp_s;
                self.schedule(at, Event::StartSession);
            }
        } else {
            for _ in 0..delta.unsigned_abs() {
                let in_set: Vec<usize> = (0..self.replicas.len())
                    .filter(|&r| self.replicas[r].in_set)
                    .collect();
                let gone = in_set[self.rng.below(in_set.len())];
                // It leaves the router's set and finishes what it is running (a drain).
                self.replicas[gone].in_set = false;
            }
            self.publish_replicas();
            self.target_sessions = self.target_sessions.saturating_sub(sessions);
        }
    }
}
