//! Closed-loop sessions against a live server: `concurrency` agents, each running one
//! generated session after another until the point's duration is up.
//!
//! A session's turns go out in order: wait the turn's think time, send the history plus
//! the turn's new input (all branches of a fan-out at once), wait for every response,
//! then append the main line's new input and the server's real output to the history,
//! as an agent does. After the deadline no new turn starts (a think time that would end
//! past it ends the session); requests in flight finish and are counted. A failed
//! main-line request ends its session, since the history it would extend is unknown.
use super::client::{Client, Output, Prompt};
use super::progress::Counters;
use crate::metrics::RequestRecord;
use crate::tokens::ids_to_text;
use crate::{Session, SessionGenerator};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the agents of one point share.
pub struct Shared {
    /// The server.
    pub client: Client,
    /// Where sessions come from.
    pub generator: SessionGenerator,
    /// Session indices start here (each point gets fresh sessions, so one point's cached
    /// prefixes don't inflate the next one's hit rate; the system prompt stays shared).
    pub first_session: u64,
    /// Sessions this point may start at most.
    pub max_sessions: u64,
    /// When the point started.
    pub start: Instant,
    /// No turn starts after this.
    pub deadline: Instant,
    /// Live counts for the progress bar.
    pub counters: Arc<Counters>,
    next: AtomicU64,
    records: Mutex<Vec<RequestRecord>>,
}

impl Shared {
    /// State for a point that starts now and runs `duration`.
    pub fn new(
        client: Client,
        generator: SessionGenerator,
        first_session: u64,
        max_sessions: u64,
        duration: Duration,
        counters: Arc<Counters>,
    ) -> Self {
        let start = Instant::now();
        Self {
            client,
            generator,
            first_session,
            max_sessions,
            start,
            deadline: start + duration,
            counters,
            next: AtomicU64::new(0),
            records: Mutex::new(Vec::new()),
        }
    }
}

/// Runs `concurrency` agents to the deadline; returns every request's record and the
/// point's wall time.
pub async fn run(shared: Arc<Shared>, concurrency: u32) -> (Vec<RequestRecord>, f64) {
    let agents: Vec<_> = (0..concurrency)
        .map(|_| tokio::spawn(agent(shared.clone())))
        .collect();
    for a in agents {
        // An agent only ends by returning; a panic inside one is a bug worth surfacing.
        a.await.expect("agent task panicked");
    }
    let elapsed = shared.start.elapsed().as_secs_f64();
    let records = std::mem::take(&mut *shared.records.lock().expect("records lock"));
    (records, elapsed)
}

async fn agent(shared: Arc<Shared>) {
    while Instant::now() < shared.deadline {
        let n = shared.next.fetch_add(1, Ordering::Relaxed);
        if n >= shared.max_sessions {
            return;
        }
        let session = shared.generator.session(shared.first_session + n);
        if run_session(&shared, &session).await.is_err() {
            // A server that fails at once would otherwise be hammered in a tight loop.
            let left = shared.deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(left.min(ERROR_BACKOFF)).await;
        }
    }
}

/// Pause of an agent whose session ended on a failed request.
const ERROR_BACKOFF: Duration = Duration::from_millis(500);

/// The main line of a session failed, so it ended early.
struct SessionFailed;

async fn run_session(shared: &Shared, s: &Session) -> Result<(), SessionFailed> {
    let id = s.id();
    let mut history = History::new(
        shared.client.api == super::client::Api::Generate,
        &s.system_prompt_ids(),
    );
    for (t, turn) in s.turns.iter().enumerate() {
        let think = Duration::from_secs_f64(turn.think_s);
        if Instant::now() + think >= shared.deadline {
            return Ok(());
        }
        tokio::time::sleep(think).await;
        let sends = turn.requests.iter().enumerate().map(|(b, r)| {
            let prompt = history.with(&s.new_input_ids(t, b));
            let (client, counters, id) = (&shared.client, &shared.counters, id.as_str());
            async move {
                counters.sent();
                let done = client
                    .complete(&prompt, r.output, Some(id), shared.start)
                    .await;
                counters.finished(done.0.error.is_some());
                done
            }
        });
        let results = futures_util::future::join_all(sends).await;
        let main_ok = results[0].0.error.is_none();
        let main_output = results[0].1.clone();
        shared
            .records
            .lock()
            .expect("records lock")
            .extend(results.into_iter().map(|r| r.0));
        if !main_ok {
            return Err(SessionFailed);
        }
        history.extend(&s.new_input_ids(t, 0));
        history.extend_output(&main_output);
    }
    Ok(())
}

/// A session's history in the form the API takes.
struct History(Prompt);

impl History {
    fn new(ids: bool, system: &[u32]) -> Self {
        let mut h = History(if ids {
            Prompt::Ids(Vec::new())
        } else {
            Prompt::Text(String::new())
        });
        h.extend(system);
        h
    }

    fn extend(&mut self, ids: &[u32]) {
        match &mut self.0 {
            Prompt::Ids(v) => v.extend_from_slice(ids),
            Prompt::Text(t) => t.push_str(&ids_to_text(ids)),
        }
    }

    fn extend_output(&mut self, out: &Output) {
        match (&mut self.0, out) {
            (Prompt::Ids(v), Prompt::Ids(o)) => v.extend_from_slice(o),
            (Prompt::Text(t), Prompt::Text(o)) => t.push_str(o),
            // The client answers in the prompt's form; a mismatch cannot arise.
            _ => unreachable!("output form differs from the prompt's"),
        }
    }

    /// The history followed by `new`.
    fn with(&self, new: &[u32]) -> Prompt {
        let mut h = History(self.0.clone());
        h.extend(new);
        h.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_history_grows_by_new_input_and_the_servers_output() {
        let mut h = History::new(true, &[1, 2]);
        assert_eq!(h.with(&[3]), Prompt::Ids(vec![1, 2, 3]));
        h.extend(&[3]);
        h.extend_output(&Prompt::Ids(vec![9, 9]));
        assert_eq!(h.with(&[4]), Prompt::Ids(vec![1, 2, 3, 9, 9, 4]));
    }

    #[test]
    fn a_text_history_appends_words_and_the_servers_text() {
        let mut h = History::new(false, &[0]);
        h.extend_output(&Prompt::Text(" reply".into()));
        assert_eq!(h.with(&[1]), Prompt::Text(" the reply of".into()));
    }
}
