//! The progress bar of one sweep point: elapsed time against `--duration`, with live
//! counts of requests, errors and requests in flight.
use indicatif::{ProgressBar, ProgressStyle};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counters the request tasks bump; a ticker task draws them.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests finished (ok or failed).
    pub done: AtomicU64,
    /// Requests failed.
    pub errors: AtomicU64,
    /// Requests sent and not finished.
    pub in_flight: AtomicU64,
}

impl Counters {
    /// Marks a request sent.
    pub fn sent(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks a request finished.
    pub fn finished(&self, failed: bool) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.done.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A progress bar redrawn four times a second until [`Progress::finish`].
pub struct Progress {
    bar: ProgressBar,
    ticker: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// Starts a bar for a point labelled `label` that runs `duration` (plus the drain).
    pub fn start(label: String, duration: Duration, counters: Arc<Counters>, hidden: bool) -> Self {
        let bar = if hidden {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(duration.as_millis() as u64)
        };
        bar.set_style(
            ProgressStyle::with_template("{prefix:>8} [{bar:30}] {elapsed:>4} / {msg}")
                .expect("the template is valid")
                .progress_chars("=> "),
        );
        bar.set_prefix(label);
        let (b, start, total) = (bar.clone(), Instant::now(), duration.as_secs());
        let ticker = tokio::spawn(async move {
            loop {
                b.set_position(start.elapsed().as_millis() as u64);
                let c = &counters;
                let (done, err, fly) = (
                    c.done.load(Ordering::Relaxed),
                    c.errors.load(Ordering::Relaxed),
                    c.in_flight.load(Ordering::Relaxed),
                );
                b.set_message(format!(
                    "{total}s  requests {done}  errors {err}  in flight {fly}"
                ));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Self { bar, ticker }
    }

    /// Stops redrawing and clears the bar.
    pub fn finish(self) {
        self.ticker.abort();
        self.bar.finish_and_clear();
    }
}
