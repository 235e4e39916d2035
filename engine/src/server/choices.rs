//! A request's `n` choices: each its own engine request, collected together, their usage
//! added up.
use serde_json::Value;

use super::openai::{collect, usage_json};
use super::pieces::{Outcome, Pieces};
use super::run::{start, Prepared};
use super::{ApiError, AppState};

/// The choices' generations, each started as its own engine request.
pub(super) fn start_choices(
    state: &AppState,
    p: &Prepared,
    session: Option<String>,
    end_of_text: Option<u32>,
) -> Result<Vec<Pieces>, ApiError> {
    (p.choices(state).iter())
        .map(|q| start(state, q, session.clone(), end_of_text))
        .collect()
}

/// Every choice's generation run to its end, read concurrently (a choice whose client
/// reads nothing would pause): each one's text and outcome.
pub(super) async fn collect_all(
    choices: &mut [Pieces],
) -> Result<Vec<(String, Outcome)>, ApiError> {
    futures_util::future::join_all(choices.iter_mut().map(collect))
        .await
        .into_iter()
        .collect()
}

/// The usage of a request's choices added up (the prompt counted once), complete once
/// every choice has ended.
pub(super) struct Total {
    left: usize,
    outcome: Option<Outcome>,
}

impl Total {
    pub(super) fn new(choices: usize) -> Self {
        Total {
            left: choices,
            outcome: None,
        }
    }

    /// Adds a choice's outcome; the usage once it was the last.
    pub(super) fn add(&mut self, o: &Outcome) -> Option<Value> {
        self.left -= 1;
        match &mut self.outcome {
            None => self.outcome = Some(o.clone()),
            Some(t) => {
                t.usage.completion_tokens += o.usage.completion_tokens;
                t.reasoning_tokens += o.reasoning_tokens;
            }
        }
        (self.left == 0).then(|| self.usage())
    }

    pub(super) fn usage(&self) -> Value {
        usage_json(self.outcome.as_ref().expect("a choice ended"))
    }
}
