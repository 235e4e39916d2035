//! A generation as a client reads it: the engine's events turned into [`Piece`]s (text
//! with stop strings applied, a thinking model's reasoning apart, log-probabilities) and
//! a final [`Outcome`].
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use tokio::sync::mpsc::Receiver;
use tokio::sync::watch;

use super::detok::Detokenizer;
use super::error::ApiError;
use super::reasoning::{Reasoning, Route};
use super::run::Slot;
use crate::scheduler::{Event, FinishReason, TokenLogprobs, Usage};

/// What a generation produced so far, piece by piece.
pub enum Piece {
    /// New text, the ids it came from and their log-probabilities (when asked for); a
    /// thinking model's new reasoning goes apart from its answer's text.
    Delta {
        text: String,
        reasoning: String,
        ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
    },
    /// The end.
    Done(Outcome),
}

/// How a generation ended.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub reason: FinishReason,
    pub usage: Usage,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    /// Generated tokens that were a thinking model's reasoning (its think tokens among
    /// them), when the reasoning was split off.
    pub reasoning_tokens: usize,
}

/// Turns engine events into [`Piece`]s with stop strings applied.
pub struct Pieces {
    _slot: Slot,
    rx: Receiver<Event>,
    /// Turns `true` when the server's shutdown deadline passes: the generation ends there.
    deadline: watch::Receiver<bool>,
    /// Tells the engine the request ended here (a stop string) when `rx` closes.
    ended_by_client: Arc<AtomicBool>,
    /// The answer's text.
    detok: Detokenizer,
    /// The reasoning's, when a thinking model's reasoning is split off.
    reasoning: Option<Reasoning>,
    /// Every generated id.
    ids: Vec<u32>,
    /// How many of them went to the reasoning.
    reasoning_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    logprobs: Vec<TokenLogprobs>,
    ready: VecDeque<Result<Piece, ApiError>>,
    done: bool,
}

impl Pieces {
    pub fn new(
        slot: Slot,
        rx: Receiver<Event>,
        deadline: watch::Receiver<bool>,
        ended_by_client: Arc<AtomicBool>,
        detok: Detokenizer,
        prompt_tokens: usize,
    ) -> Self {
        Pieces {
            _slot: slot,
            rx,
            deadline,
            ended_by_client,
            detok,
            reasoning: None,
            ids: Vec::new(),
            reasoning_tokens: 0,
            prompt_tokens,
            cached_tokens: 0,
            logprobs: Vec::new(),
            ready: VecDeque::new(),
            done: false,
        }
    }

    /// All ids generated so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Splits a thinking model's reasoning from its answer: pieces carry it apart.
    pub fn split_reasoning(mut self, reasoning: Reasoning) -> Self {
        self.reasoning = Some(reasoning);
        self
    }

    /// The reasoning so far, when it is split off.
    pub fn reasoning(&self) -> Option<&str> {
        self.reasoning.as_ref().map(Reasoning::text)
    }

    /// No text from here on: the pieces carry ids only (a reply forced into a tool call).
    pub fn close_text(&mut self) {
        self.detok.close();
    }

    /// Whether every piece has been taken.
    pub(super) fn ended(&self) -> bool {
        self.done && self.ready.is_empty()
    }

    /// Their log-probabilities, when the request asked for them.
    pub fn logprobs(&self) -> &[TokenLogprobs] {
        &self.logprobs
    }

    /// The next piece; `None` after the end. A stop string ends the generation there and
    /// closes the engine's channel, which aborts the request and frees its pages.
    ///
    /// Past the server's shutdown deadline the generation ends with a 503 error piece (the
    /// engine's channel closes, which aborts the request).
    pub async fn next(&mut self) -> Option<Result<Piece, ApiError>> {
        while self.ready.is_empty() && !self.done {
            tokio::select! {
                event = self.rx.recv() => self.take(event),
                () = deadline_passed(&mut self.deadline) => {
                    self.rx.close();
                    self.ready.push_back(Err(ApiError::with_status(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "shutting_down",
                        "the server shut down before this request finished",
                    )));
                    self.done = true;
                }
            }
        }
        self.ready.pop_front()
    }

    fn take(&mut self, event: Option<Event>) {
        let fail = |status, code, why: String| Err(ApiError::with_status(status, code, why));
        match event {
            Some(Event::Admitted { cached_tokens }) => self.cached_tokens = cached_tokens,
            Some(Event::Token(t, logprobs)) => {
                self.ids.push(t);
                let (text, reasoning) = match self.reasoning.as_mut().map(|r| r.route(t)) {
                    Some(Route::Reasoning(r)) => {
                        self.reasoning_tokens += 1;
                        (String::new(), r)
                    }
                    Some(Route::Answer(rest)) => (self.detok.push(t), rest),
                    None => (self.detok.push(t), String::new()),
                };
                let logprobs: Vec<TokenLogprobs> = logprobs.map(|l| *l).into_iter().collect();
                self.logprobs.extend(logprobs.iter().cloned());
                self.ready.push_back(Ok(Piece::Delta {
                    text,
                    reasoning,
                    ids: vec![t],
                    logprobs,
                }));
                if self.detok.stopped() {
                    self.ended_by_client.store(true, Ordering::Release);
                    self.rx.close();
                    let usage = Usage {
                        prompt_tokens: self.prompt_tokens,
                        cached_tokens: self.cached_tokens,
                        completion_tokens: self.ids.len(),
                        ..Usage::default()
                    };
                    self.end(FinishReason::Stop, usage);
                }
            }
            Some(Event::Finished { reason, usage }) => {
                let reasoning = (self.reasoning.as_mut()).map_or(String::new(), Reasoning::finish);
                let text = self.detok.finish();
                if !text.is_empty() || !reasoning.is_empty() {
                    self.ready.push_back(Ok(Piece::Delta {
                        text,
                        reasoning,
                        ids: vec![],
                        logprobs: vec![],
                    }));
                }
                self.end(reason, usage);
            }
            Some(Event::Failed(why)) => {
                self.ready
                    .push_back(fail(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", why));
                self.done = true;
            }
            None => {
                let why = "the engine stopped".to_string();
                self.ready
                    .push_back(fail(StatusCode::SERVICE_UNAVAILABLE, "engine_stopped", why));
                self.done = true;
            }
        }
    }

    fn end(&mut self, reason: FinishReason, usage: Usage) {
        let stop_string = self.detok.stop_string().map(str::to_string);
        self.ready.push_back(Ok(Piece::Done(Outcome {
            reason,
            usage,
            stop_string,
            reasoning_tokens: self.reasoning_tokens,
        })));
        self.done = true;
    }
}

/// Returns once `deadline` holds `true` (never, if its sender is gone).
async fn deadline_passed(deadline: &mut watch::Receiver<bool>) {
    if deadline.wait_for(|&passed| passed).await.is_err() {
        std::future::pending::<()>().await;
    }
}
