//! The router's background upkeep: scrape, health, reload, placer ticks.
//!
//! Every interval each replica's /metrics is fetched (all at once, each with a timeout
//! of the interval, at least 200 ms). A good scrape records its load and marks the
//! replica up; [`FAILURES_TO_DRAIN`] failures in a row mark it down (drained: no
//! requests) until a scrape succeeds again. Then the placer's upkeep runs (session
//! expiry, recount, rebalancing) and, if the replica file changed, the list is
//! reloaded. SIGHUP also reloads it.

use crate::proxy::AppState;
use crate::scrape::{is_draining, parse_metrics};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Consecutive failed scrapes that drain a replica.
pub const FAILURES_TO_DRAIN: u32 = 2;

/// Runs the upkeep loop forever at `interval`.
pub async fn upkeep(state: Arc<AppState>, interval: Duration) {
    let mut failures: HashMap<u64, u32> = HashMap::new();
    let mut stamp = state.source.file_stamp();
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let timeout = interval.max(Duration::from_millis(200));
    loop {
        ticker.tick().await;
        let targets: Vec<(u64, String)> = state
            .placer()
            .replicas()
            .iter()
            .map(|r| (r.id, r.name.clone()))
            .collect();
        let scrapes = targets.iter().map(|(_, base)| {
            let client = state.client.clone();
            let url = format!("{base}/metrics");
            async move {
                let response = client.get(url).timeout(timeout).send().await.ok()?;
                let text = response.error_for_status().ok()?.text().await.ok()?;
                Some((parse_metrics(&text), is_draining(&text)))
            }
        });
        let results = futures_util::future::join_all(scrapes).await;
        let now = state.now_ms();
        {
            let mut placer = state.placer();
            for ((id, base), result) in targets.iter().zip(results) {
                match result {
                    Some((_, true)) => {
                        if placer.replica(*id).is_some_and(|r| r.up) {
                            tracing::info!(replica = %base, "replica drains for shutdown, out of rotation");
                        }
                        placer.set_up(*id, false);
                    }
                    Some((scraped, false)) => {
                        failures.remove(id);
                        if placer.replica(*id).is_some_and(|r| !r.up) {
                            tracing::info!(replica = %base, "replica answers again");
                        }
                        placer.set_up(*id, true);
                        if let Some(scraped) = scraped {
                            placer.set_scraped(*id, scraped);
                        }
                    }
                    None => {
                        let n = failures.entry(*id).or_insert(0);
                        *n += 1;
                        if *n == FAILURES_TO_DRAIN {
                            tracing::warn!(replica = %base, "health checks failed, draining");
                            placer.set_up(*id, false);
                        }
                    }
                }
            }
            placer.tick(now);
        }
        let new_stamp = state.source.file_stamp();
        if new_stamp != stamp {
            stamp = new_stamp;
            reload(&state, "replica file changed");
        }
    }
}

/// Reloads the replica list, logging the outcome (a bad file keeps the old list).
pub fn reload(state: &AppState, why: &str) {
    match state.reload() {
        Ok(n) => tracing::info!("{why}: {n} replicas"),
        Err(err) => tracing::error!("{why}: keeping the previous replicas: {err}"),
    }
}

/// Reloads the replica list on every SIGHUP, forever.
#[cfg(unix)]
pub async fn reload_on_sighup(state: Arc<AppState>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hangups) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; the replica file is still watched");
        return;
    };
    while hangups.recv().await.is_some() {
        reload(&state, "SIGHUP");
    }
}
