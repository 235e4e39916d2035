//! A replica's service model: admission up to a batch limit, processor sharing beyond.
//!
//! A request's work is its unloaded service time: uncached prompt tokens at the prefill
//! rate plus output tokens at the decode rate (cached prompt tokens cost nothing). Up to
//! `max_running` requests run at once and share the replica: with `n` running each
//! progresses at `1 / (1 + slowdown * (n - 1))` of its unloaded speed, so latency grows
//! with load (a batched decode step gets slower as the batch grows). Further arrivals
//! wait in FIFO order; the wait is the queueing delay. Times are seconds.

use std::collections::VecDeque;

/// Speeds of one replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceParams {
    /// Uncached prompt tokens per second, unloaded.
    pub prefill_tokens_per_s: f64,
    /// Output tokens per second for one request, unloaded.
    pub decode_tokens_per_s: f64,
    /// Per-request slowdown per extra running request.
    pub slowdown: f64,
    /// Requests running at once; more wait.
    pub max_running: usize,
}

impl ServiceParams {
    /// Unloaded seconds for a request.
    pub fn work_s(&self, uncached_tokens: u64, output_tokens: u32) -> f64 {
        uncached_tokens as f64 / self.prefill_tokens_per_s
            + f64::from(output_tokens) / self.decode_tokens_per_s
    }
}

/// One replica's running and waiting requests; `T` identifies a request.
#[derive(Debug, Clone)]
pub struct Service<T> {
    params: ServiceParams,
    running: Vec<(T, f64)>,
    waiting: VecDeque<(T, f64, f64)>,
    now: f64,
}

impl<T: Copy> Service<T> {
    /// An idle replica.
    pub fn new(params: ServiceParams) -> Self {
        Self {
            params,
            running: Vec::new(),
            waiting: VecDeque::new(),
            now: 0.0,
        }
    }

    /// Running plus waiting requests.
    pub fn load(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Requests running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    fn rate(&self) -> f64 {
        1.0 / (1.0 + self.params.slowdown * (self.running.len().saturating_sub(1)) as f64)
    }

    /// Moves the clock to `now`, progressing running requests.
    pub fn advance(&mut self, now: f64) {
        let progress = (now - self.now).max(0.0) * self.rate();
        for (_, left) in &mut self.running {
            *left -= progress;
        }
        self.now = now.max(self.now);
    }

    /// A request of `work_s` arrives at `now`; returns its queueing delay if it starts now.
    pub fn arrive(&mut self, id: T, work_s: f64, now: f64) -> Option<f64> {
        self.advance(now);
        if self.running.len() < self.params.max_running {
            self.running.push((id, work_s));
            Some(0.0)
        } else {
            self.waiting.push_back((id, work_s, now));
            None
        }
    }

    /// When the next running request ends if nothing arrives.
    pub fn next_finish(&self) -> Option<f64> {
        let least = self
            .running
            .iter()
            .map(|&(_, left)| left)
            .min_by(f64::total_cmp)?;
        Some(self.now + least.max(0.0) / self.rate())
    }

    /// Finishes every request done by `now`; returns them and the queueing delays of the
    /// waiting requests that start in their place.
    pub fn complete(&mut self, now: f64) -> (Vec<T>, Vec<(T, f64)>) {
        self.advance(now);
        // Event times are whole microseconds: work left below that is float error.
        let (done, running): (Vec<_>, Vec<_>) =
            self.running.drain(..).partition(|&(_, left)| left <= 1e-6);
        self.running = running;
        let mut started = Vec::new();
        while self.running.len() < self.params.max_running {
            let Some((id, work, since)) = self.waiting.pop_front() else {
                break;
            };
            self.running.push((id, work));
            started.push((id, now - since));
        }
        (done.into_iter().map(|(id, _)| id).collect(), started)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(max_running: usize) -> ServiceParams {
        ServiceParams {
            prefill_tokens_per_s: 1000.0,
            decode_tokens_per_s: 10.0,
            slowdown: 0.5,
            max_running,
        }
    }

    #[test]
    fn cached_tokens_cost_nothing_and_outputs_cost_decode_time() {
        assert_eq!(params(1).work_s(2000, 10), 3.0);
    }

    #[test]
    fn a_lone_request_takes_its_unloaded_time() {
        let mut s = Service::new(params(4));
        assert_eq!(s.arrive(1, 2.0, 0.0), Some(0.0));
        assert_eq!(s.next_finish(), Some(2.0));
        assert_eq!(s.complete(2.0).0, vec![1]);
    }

    #[test]
    fn sharing_the_replica_slows_every_request() {
        let mut s = Service::new(params(4));
        s.arrive(1, 2.0, 0.0);
        s.arrive(2, 2.0, 0.0);
        // Two running: each at 1 / 1.5 speed.
        assert!((s.next_finish().unwrap() - 3.0).abs() < 1e-12);
        let (done, _) = s.complete(3.0);
        assert_eq!(done, vec![1, 2]);
    }

    #[test]
    fn requests_past_the_batch_limit_wait_and_report_their_delay() {
        let mut s = Service::new(params(1));
        s.arrive(1, 2.0, 0.0);
        assert_eq!(s.arrive(2, 1.0, 0.5), None);
        assert_eq!(s.load(), 2);
        let (done, started) = s.complete(2.0);
        assert_eq!(done, vec![1]);
        assert_eq!(started, vec![(2, 1.5)]);
        assert_eq!(s.next_finish(), Some(3.0));
    }
}
