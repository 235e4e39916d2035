//! How many tokens each decoding request drafts in a step, from what verification costs and
//! what drafts earn ([`DraftPolicy::Measured`]).
//!
//! A step of `b` decoding requests that runs `n` drafted tokens beside their own takes
//! `t(b, b + n)` seconds, measured ([`StepCosts`]). A request's `j`-th drafted token adds an
//! emitted token when it and every one before it are accepted, with probability `S(j)`
//! estimated from the request's own verifications by depth, from a prior of all requests'
//! lately ([`Acceptance`]: no model of how acceptance falls with depth, so a drafter whose
//! drafts are right up to a point and then wrong is read as such). [`draft_budgets`] runs
//! the `n` drafted tokens of highest `S(j)` that maximise tokens emitted per second,
//! `(b + sum of S(j)) / t(b, b + n)`, and none unless that beats the plain step's
//! `b / t(b, b)` by [`MIN_GAIN`]: speculation is off wherever it cannot pay, per batch
//! size, on the costs of the card it runs on.
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// How the engine sizes drafts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Every decoding request drafts the most it may ([`super::draft_len`]).
    Fixed,
    /// Budgets from measured step times and acceptance ([`draft_budgets`]).
    Measured,
}

/// Speculate only for a predicted speed-up of at least this (estimates are noisy, and a
/// wrong guess costs speed).
pub const MIN_GAIN: f64 = 1.05;
/// Weight of the newest verification in one request's acceptance estimate.
const WEIGHT: f64 = 0.2;
/// Weight of the newest verification in all requests' estimate (about the latest 50).
const ALL_WEIGHT: f64 = 0.02;
/// What a request's own evidence keeps of itself over a step in which it drafts nothing
/// (half of it fades in about 70 such steps).
const FADE_KEEP: f64 = 0.99;
/// A step time is the median of the latest this many of its size: one slow step (a kernel
/// compiled on first use, a host hiccup) does not set it.
const RECENT_STEPS: usize = 5;
/// A batch's plain step is measured again once its time is this old: while drafts run,
/// no plain step would refresh it, and contexts grow.
pub const REFRESH: Duration = Duration::from_secs(2);

/// A request's estimates lean on all requests' lately, never taken as under a rate of this
/// per token: where drafting is cheap, a request with no verifications of its own still
/// tries a short draft, so acceptance that returns is noticed; a request whose own drafts
/// failed drifts back toward all requests' estimate while it drafts nothing
/// ([`Acceptance::fade`]).
pub const EXPLORE_RATE: f64 = 0.15;
/// Deepest draft position tracked; the policy drafts no deeper.
pub const MAX_DEPTH: usize = 32;
/// What all requests' acceptance weighs in one request's estimate, in verifications.
const PRIOR_WEIGHT: f64 = 2.0;

/// How drafted tokens fare by depth: for each `j`, decayed counts of verifications that
/// drafted at least `j` tokens and of those that accepted at least `j`, whose ratio
/// estimates `S(j)`, the chance that the first `j` drafted tokens are all accepted. Kept
/// for each request and for all requests together.
#[derive(Clone, Copy, Debug)]
pub struct Acceptance {
    tried: [f64; MAX_DEPTH],
    passed: [f64; MAX_DEPTH],
    /// Weight of the newest verification.
    weight: f64,
}

impl Default for Acceptance {
    /// One request's, with no verifications yet.
    fn default() -> Self {
        Acceptance {
            tried: [0.0; MAX_DEPTH],
            passed: [0.0; MAX_DEPTH],
            weight: WEIGHT,
        }
    }
}

impl Acceptance {
    /// All requests', as if [`PRIOR_WEIGHT`] verifications had accepted each drafted
    /// token with probability `rate`.
    pub fn geometric(rate: f64) -> Self {
        let mut a = Acceptance {
            weight: ALL_WEIGHT,
            ..Acceptance::default()
        };
        for j in 0..MAX_DEPTH {
            a.tried[j] = PRIOR_WEIGHT;
            a.passed[j] = PRIOR_WEIGHT * rate.powi(j as i32 + 1);
        }
        a
    }

    /// Verification kept `accepted` of `drafted` tokens: news of the drafted depths only.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        let keep = 1.0 - self.weight;
        for j in 0..drafted.min(MAX_DEPTH) {
            self.tried[j] = self.tried[j] * keep + 1.0;
            self.passed[j] = self.passed[j] * keep + f64::from(u8::from(j < accepted));
        }
    }

    /// A step without drafts: the evidence fades a little (see [`FADE_KEEP`]).
    pub fn fade(&mut self) {
        for j in 0..MAX_DEPTH {
            self.tried[j] *= FADE_KEEP;
            self.passed[j] *= FADE_KEEP;
        }
    }

    /// What each of the first `most` drafted tokens earns, `S(1..=most)` (non-increasing;
    /// 0 past [`MAX_DEPTH`]): these counts, and `all`'s estimate (never under
    /// [`EXPLORE_RATE`]`^j`) worth [`PRIOR_WEIGHT`] verifications more. `all` holds every
    /// request's verifications and starts [`Acceptance::geometric`], so its own estimate
    /// is its ratio.
    pub fn gains(&self, all: &Acceptance, most: usize) -> Vec<f64> {
        let mut floor = 1.0;
        (0..most)
            .map(|j| {
                if j >= MAX_DEPTH {
                    return 0.0;
                }
                let prior = (all.passed[j] / all.tried[j]).max(EXPLORE_RATE.powi(j as i32 + 1));
                let s = (self.passed[j] + PRIOR_WEIGHT * prior) / (self.tried[j] + PRIOR_WEIGHT);
                floor = s.min(floor);
                floor
            })
            .collect()
    }
}

/// Decode steps' measured seconds by (decoding requests, tokens run): the latest few of
/// each size, and when the latest was taken.
#[derive(Debug, Default)]
pub struct StepCosts {
    seconds: BTreeMap<(usize, usize), (VecDeque<f64>, Instant)>,
    /// When a plain step was last asked for, by batch.
    probes: BTreeMap<usize, Instant>,
}

impl StepCosts {
    /// A step of `requests` decoding requests running `rows` tokens took `seconds`.
    pub fn observe(&mut self, requests: usize, rows: usize, seconds: f64) {
        self.observe_at(requests, rows, seconds, Instant::now());
    }

    /// [`Self::observe`], taken at `now`.
    pub fn observe_at(&mut self, requests: usize, rows: usize, seconds: f64, now: Instant) {
        let (recent, at) = self
            .seconds
            .entry((requests, rows))
            .or_insert_with(|| (VecDeque::new(), now));
        if recent.len() == RECENT_STEPS {
            recent.pop_front();
        }
        recent.push_back(seconds);
        *at = now;
    }

    /// Whether the step about to run at `requests` decoding requests should be a plain one
    /// (no drafts), to measure the plain step again: its time is missing or older than
    /// [`REFRESH`], and no such probe was asked for at this batch within [`REFRESH`] (a
    /// step that also prefills is not measured, so a probe may miss; drafting goes on
    /// meanwhile).
    pub fn probe_plain(&mut self, requests: usize, now: Instant) -> bool {
        let stale = |at: &Instant| now.duration_since(*at) >= REFRESH;
        let due = self
            .seconds
            .get(&(requests, requests))
            .is_none_or(|(_, at)| stale(at));
        let probed = self.probes.get(&requests).is_some_and(|at| !stale(at));
        if due && !probed {
            self.probes.insert(requests, now);
        }
        due && !probed
    }

    /// Seconds, at `now`, of a step of `requests` decoding requests running `rows`
    /// tokens: measured; else interpolated between the nearest measured row counts of
    /// that batch; else, past the largest measured, extrapolated along the line through
    /// the two largest (never under the largest's time), or, with only one measured, its
    /// time (optimistic, so that drafting at this batch is tried once and its cost then
    /// known). A size with drafts measured only once, [`REFRESH`] or more before `now`, is
    /// left out, so it is tried and measured again: its one measurement may be slow (a
    /// kernel compiled for a new size, a host hiccup) and would otherwise keep the policy
    /// from ever drafting at that size again. Sizes measured more often keep their median
    /// (leaving every old size out made each look as cheap as a plain step every 2 s, and
    /// drafting at a loss followed: 0.89x at batch 1 with nothing accepted, H100,
    /// 2026-12-06). `None` before any step of that batch was measured at or under `rows`.
    pub fn estimate(&self, requests: usize, rows: usize, now: Instant) -> Option<f64> {
        let trusted = |(&(_, r), (recent, at)): &(&(usize, usize), &(VecDeque<f64>, Instant))| {
            r == requests || recent.len() > 1 || now.duration_since(*at) < REFRESH
        };
        let batch = (self.seconds.range((requests, 0)..=(requests, usize::MAX))).filter(trusted);
        let line = |(r0, t0): (usize, f64), (r1, t1): (usize, f64)| {
            t0 + (t1 - t0) * (rows as f64 - r0 as f64) / (r1 - r0) as f64
        };
        let point = |(&(_, r), (recent, _)): (&(usize, usize), &(VecDeque<f64>, Instant))| {
            let mut sorted: Vec<f64> = recent.iter().copied().collect();
            sorted.sort_by(f64::total_cmp);
            (r, sorted[(sorted.len() - 1) / 2])
        };
        let mut below = batch
            .clone()
            .rev()
            .filter(|(&(_, r), _)| r <= rows)
            .map(point);
        let above = batch.clone().find(|(&(_, r), _)| r >= rows).map(point);
        match (below.next(), above) {
            (Some(low), Some(high)) if high.0 > low.0 => Some(line(low, high)),
            (Some((r, t)), _) if r == rows => Some(t),
            (Some(last), None) => Some(
                below
                    .next()
                    .map_or(last.1, |prev| line(prev, last).max(last.1)),
            ),
            (Some(_), Some(_)) | (None, _) => None,
        }
    }
}

/// Tokens each decoding request drafts this step: see the module docs. `gains` holds, for
/// each request, what its drafted tokens earn in order (`S(1)`, `S(2)`, ... up to the most
/// it may draft; non-increasing); `step_seconds(rows)` estimates a step of all of them
/// running `rows` tokens.
pub fn draft_budgets(
    gains: &[Vec<f64>],
    step_seconds: impl Fn(usize) -> Option<f64>,
) -> Vec<usize> {
    let b = gains.len();
    let mut budgets = vec![0; b];
    let Some(plain) = step_seconds(b) else {
        return budgets;
    };
    // Every request's j-th drafted token and what it earns, best first (a request's own
    // tokens stay in order: their gains do not rise, and the sort is stable).
    let mut tokens: Vec<(f64, usize)> = gains
        .iter()
        .enumerate()
        .flat_map(|(i, g)| g.iter().map(move |&earns| (earns, i)))
        .collect();
    tokens.sort_by(|x, y| y.0.total_cmp(&x.0));
    let (mut best, mut take) = (MIN_GAIN * b as f64 / plain, 0);
    let mut emitted = b as f64;
    for (n, &(earns, _)) in tokens.iter().enumerate() {
        emitted += earns;
        if let Some(t) = step_seconds(b + n + 1) {
            if emitted / t > best {
                (best, take) = (emitted / t, n + 1);
            }
        }
    }
    for &(_, i) in &tokens[..take] {
        budgets[i] += 1;
    }
    budgets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step of 4 requests: 10 ms plain, `per_row` more per drafted token.
    fn linear(per_row: f64) -> impl Fn(usize) -> Option<f64> {
        move |rows| Some(0.010 + per_row * (rows - 4) as f64)
    }

    /// Gains of `most` drafted tokens each accepted with probability `rate` (as known
    /// from all requests: a request with no verifications of its own).
    fn geometric(requests: &[(f64, usize)]) -> Vec<Vec<f64>> {
        requests
            .iter()
            .map(|&(rate, most)| Acceptance::default().gains(&Acceptance::geometric(rate), most))
            .collect()
    }

    #[test]
    fn cheap_verification_drafts_the_most_and_dear_verification_nothing() {
        let sure = geometric(&[(0.9, 5); 4]);
        assert_eq!(draft_budgets(&sure, linear(0.0001)), vec![5; 4]);
        // Each drafted token costs a quarter of a plain step: not worth it even at 0.9.
        assert_eq!(draft_budgets(&sure, linear(0.0025)), vec![0; 4]);
        assert_eq!(
            draft_budgets(&sure, |_| None),
            vec![0; 4],
            "nothing measured"
        );
    }

    #[test]
    fn budgets_follow_each_requests_acceptance() {
        let mixed = geometric(&[(0.9, 5), (0.05, 5), (0.6, 5), (0.9, 2)]);
        let b = draft_budgets(&mixed, linear(0.0004));
        assert_eq!(b[1], 0, "a request whose drafts fail drafts nothing: {b:?}");
        assert!(b[0] > b[2] && b[2] > 0, "{b:?}");
        assert!(b[3] <= 2, "never past a request's limit: {b:?}");
    }

    #[test]
    fn a_gain_under_the_margin_is_not_taken() {
        // One drafted token earning 0.2: 4.2 tokens for 4 would be 5% more at no cost,
        // but it costs 1%: 3.96% is under the margin.
        let one = vec![vec![0.2], vec![0.0], vec![0.0], vec![0.0]];
        assert_eq!(draft_budgets(&one, linear(0.0001)), vec![0; 4]);
    }

    #[test]
    fn step_costs_interpolate_and_try_unmeasured_sizes_once() {
        let mut c = StepCosts::default();
        let t0 = Instant::now();
        assert_eq!(c.estimate(4, 4, t0), None);
        c.observe(4, 4, 0.010);
        c.observe(4, 12, 0.020);
        assert_eq!(c.estimate(4, 4, t0), Some(0.010));
        assert!((c.estimate(4, 8, t0).unwrap() - 0.015).abs() < 1e-12);
        assert!(
            (c.estimate(4, 20, t0).unwrap() - 0.030).abs() < 1e-12,
            "along the line"
        );
        assert_eq!(
            c.estimate(5, 5, t0),
            None,
            "another batch size is not this one"
        );
        c.observe(5, 5, 0.011);
        assert_eq!(
            c.estimate(5, 9, t0),
            Some(0.011),
            "optimistic with one point"
        );
    }

    #[test]
    fn a_size_with_drafts_measured_once_is_tried_again_once_its_time_is_old() {
        let mut c = StepCosts::default();
        let t0 = Instant::now();
        c.observe_at(4, 4, 0.010, t0);
        // A drafted size first run while its kernels compiled: far too slow.
        c.observe_at(4, 16, 0.500, t0);
        assert_eq!(c.estimate(4, 16, t0), Some(0.500));
        // Old, it is left out: the plain step's time stands for it, so drafting is tried.
        let later = t0 + REFRESH;
        assert_eq!(c.estimate(4, 16, later), Some(0.010));
        c.observe_at(4, 16, 0.014, later);
        assert_eq!(
            c.estimate(4, 16, later),
            Some(0.014),
            "the lower of two, as a median"
        );
        // Measured twice, it stays trusted however old.
        assert_eq!(c.estimate(4, 16, later + 10 * REFRESH), Some(0.014));
    }

    #[test]
    fn a_step_time_is_the_median_of_its_latest_and_plain_steps_are_refreshed() {
        let mut c = StepCosts::default();
        let t0 = Instant::now();
        assert!(c.probe_plain(4, t0), "never measured");
        assert!(!c.probe_plain(4, t0), "asked for already");
        // A first step that compiled kernels, then ordinary ones.
        for s in [2.5, 0.010, 0.012, 0.011] {
            c.observe_at(4, 4, s, t0);
        }
        assert_eq!(c.estimate(4, 4, t0), Some(0.011));
        for s in [0.020; RECENT_STEPS] {
            c.observe_at(4, 4, s, t0);
        }
        assert_eq!(c.estimate(4, 4, t0), Some(0.020), "only the latest count");
        assert!(!c.probe_plain(4, t0 + REFRESH / 2));
        c.observe_at(4, 12, 0.030, t0 + REFRESH);
        assert!(
            c.probe_plain(4, t0 + REFRESH),
            "stale: a step with drafts is not a plain one"
        );
        assert!(!c.probe_plain(4, t0 + REFRESH), "once per REFRESH");
    }

    #[test]
    fn acceptance_is_estimated_by_depth() {
        let all = Acceptance::geometric(0.5);
        let mut a = Acceptance::default();
        assert!(
            (a.gains(&all, 2)[1] - 0.25).abs() < 1e-12,
            "all requests' at first"
        );
        // Drafts right for three tokens and wrong at the fourth, every time: S reads 1,
        // 1, 1, then 0, where a per-token rate would say 0.75 each.
        for _ in 0..60 {
            a.record(5, 3);
        }
        let s = a.gains(&a, 5);
        assert!(s[..3].iter().all(|&x| x > 0.99) && s[3] < 0.01, "{s:?}");
        // Depths never drafted keep all requests' estimate, capped by the depths before.
        let mut short = Acceptance::default();
        for _ in 0..60 {
            short.record(2, 0);
        }
        // (all requests' 0.9 keeps a weight of 2 against about 5 of its own rejections)
        let s = short.gains(&Acceptance::geometric(0.9), 6);
        assert!(s[0] < 0.3 && s[5] <= s[0], "{s:?}");
        assert_eq!(a.gains(&a, MAX_DEPTH + 1)[MAX_DEPTH], 0.0);
    }

    #[test]
    fn a_request_leans_on_all_requests_acceptance_floored_to_explore() {
        let mut all = Acceptance::geometric(0.5);
        for _ in 0..400 {
            all.record(4, 4);
        }
        let new = Acceptance::default();
        assert!(new.gains(&all, 4)[3] > 0.9, "high acceptance carries over");
        // One early verification of its own does not hold a request back once all
        // requests' acceptance says its drafts pay.
        let mut unlucky = Acceptance::default();
        unlucky.record(4, 0);
        assert!(unlucky.gains(&all, 1)[0] > 0.6);
        for _ in 0..400 {
            all.record(4, 0);
        }
        let g = new.gains(&all, 2);
        assert!((g[0] - EXPLORE_RATE).abs() < 1e-6, "{g:?}");
        // A request whose drafts failed, while it drafts nothing, drifts back toward
        // all requests' estimate.
        let mut failed = Acceptance::default();
        for _ in 0..20 {
            failed.record(4, 0);
        }
        let mut good = Acceptance::geometric(0.9);
        for _ in 0..400 {
            good.record(4, 4);
        }
        assert!(failed.gains(&good, 1)[0] < 0.3);
        for _ in 0..500 {
            failed.fade();
        }
        assert!(
            failed.gains(&good, 1)[0] > 0.8,
            "{:?}",
            failed.gains(&good, 1)
        );
        // A request's own verifications soon outweigh all requests'.
        let mut own = Acceptance::default();
        for _ in 0..10 {
            own.record(4, 4);
        }
        assert!(own.gains(&all, 4)[3] > 0.65);
    }
}
