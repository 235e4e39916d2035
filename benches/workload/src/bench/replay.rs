//! Mooncake trace replay against a live server, closed-loop or on the trace's clock.
//!
//! Closed-loop: `concurrency` workers take the trace's requests in order, each sending
//! its next one when the previous answer is in. Timed: each request is sent at its
//! `timestamp` (divided by `speedup`) after the point's start, whatever is in flight.
//! Either way no request starts after the deadline, and in-flight ones finish. Each
//! point tokenizes the trace under its own seed, so its prefixes are not already cached
//! from the previous point.
use super::client::{Client, Prompt};
use super::progress::Counters;
use crate::metrics::RequestRecord;
use crate::tokens::ids_to_text;
use crate::trace::{TraceRequest, TraceTokenizer};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A trace and how to send it.
pub struct Replay {
    /// The server.
    pub client: Client,
    /// The requests, in file order.
    pub trace: Vec<TraceRequest>,
    /// Lengths and ids at the run's scale and this point's seed.
    pub tokenizer: TraceTokenizer,
    /// Live counts for the progress bar.
    pub counters: Arc<Counters>,
}

impl Replay {
    async fn send(&self, line: usize, start: Instant) -> RequestRecord {
        let r = &self.trace[line];
        let ids = self.tokenizer.input_ids(r, line);
        let prompt = match self.client.api {
            super::client::Api::Generate => Prompt::Ids(ids),
            super::client::Api::Text => Prompt::Text(ids_to_text(&ids)),
        };
        self.counters.sent();
        let (record, _) = self
            .client
            .complete(&prompt, self.tokenizer.output_len(r), None, start)
            .await;
        self.counters.finished(record.error.is_some());
        record
    }
}

/// Closed-loop replay with `concurrency` workers until `duration` or the trace's end.
pub async fn closed_loop(
    replay: Arc<Replay>,
    concurrency: u32,
    duration: Duration,
) -> (Vec<RequestRecord>, f64) {
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (replay, next) = (replay.clone(), next.clone());
            tokio::spawn(async move {
                let mut records = Vec::new();
                while start.elapsed() < duration {
                    let line = next.fetch_add(1, Ordering::Relaxed);
                    if line >= replay.trace.len() {
                        break;
                    }
                    records.push(replay.send(line, start).await);
                }
                records
            })
        })
        .collect();
    let mut records = Vec::new();
    for w in workers {
        records.extend(w.await.expect("replay worker panicked"));
    }
    (records, start.elapsed().as_secs_f64())
}

/// Sends every request at its timestamp (relative to the first, divided by `speedup`).
pub async fn timed(
    replay: Arc<Replay>,
    speedup: f64,
    duration: Duration,
) -> (Vec<RequestRecord>, f64) {
    let start = Instant::now();
    let t0 = replay.trace.iter().map(|r| r.timestamp).min().unwrap_or(0);
    let mut tasks = Vec::new();
    for line in 0..replay.trace.len() {
        let at =
            Duration::from_secs_f64((replay.trace[line].timestamp - t0) as f64 / 1000.0 / speedup);
        if at >= duration {
            break;
        }
        tokio::time::sleep_until((start + at).into()).await;
        let replay = replay.clone();
        tasks.push(tokio::spawn(async move { replay.send(line, start).await }));
    }
    let mut records = Vec::new();
    for t in tasks {
        records.push(t.await.expect("replay request panicked"));
    }
    (records, start.elapsed().as_secs_f64())
}
