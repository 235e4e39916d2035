//! One generation as the endpoints share it: sampling parameters checked, the prompt
//! checked against the model, the request queued (or refused with 503 when the queue is
//! full), and the engine's events turned into text pieces and a final outcome.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use serde::Deserialize;
use tokio::sync::mpsc::{channel, Receiver};
use tokio::sync::watch;

use super::detok::Detokenizer;
use super::error::ApiError;
use super::grammar::Grammar;
use super::reasoning::{Reasoning, Route};
use super::AppState;
use crate::scheduler::{
    Event, FinishReason, SamplingParams, Submission, TokenLogprobs, Usage, EVENT_BUFFER,
};

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// What an endpoint calls the sampling fields (errors name them as the client sent them).
#[derive(Debug)]
pub struct SamplingNames {
    pub max_tokens: &'static str,
    pub temperature: &'static str,
    pub top_p: &'static str,
    pub top_k: &'static str,
    pub min_p: &'static str,
    pub n: &'static str,
}

/// OpenAI's endpoints.
pub const OPENAI_NAMES: SamplingNames = SamplingNames {
    max_tokens: "max_tokens",
    temperature: "temperature",
    top_p: "top_p",
    top_k: "top_k",
    min_p: "min_p",
    n: "n",
};

/// SGLang's `/generate`.
pub const SGLANG_NAMES: SamplingNames = SamplingNames {
    max_tokens: "sampling_params.max_new_tokens",
    temperature: "sampling_params.temperature",
    top_p: "sampling_params.top_p",
    top_k: "sampling_params.top_k",
    min_p: "sampling_params.min_p",
    n: "sampling_params.n",
};

/// Sampling fields as the endpoints receive them (OpenAI and SGLang names).
#[derive(Clone, Debug)]
pub struct RawSampling {
    pub names: &'static SamplingNames,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 or -1: every token.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub n: Option<i64>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    /// Log-probabilities of the generated tokens and this many alternatives (checked by
    /// the endpoint, at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<usize>,
}

/// Most alternatives a token's log-probabilities list (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A request ready for the engine.
#[derive(Clone)]
pub struct Prepared {
    pub id: u64,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub stops: Vec<String>,
    /// Completions asked for (`n`): choice `i` is its own engine request, seeded
    /// `seed + i` ([`Prepared::choices`]).
    pub n: usize,
    /// What the output must match (each choice follows it with its own matcher).
    pub grammar: Option<Grammar>,
}

/// Most completions one request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;

impl Prepared {
    /// The `n` engine requests of the choices: this one, then copies with new ids and
    /// the following seeds (each is drawn independently; the prompt's KV is shared
    /// through the prefix cache once one of them has computed it).
    pub fn choices(&self, state: &AppState) -> Vec<Prepared> {
        (0..self.n)
            .map(|i| match i {
                0 => self.clone(),
                _ => {
                    let mut p = self.clone();
                    p.id = state.engine.next_id();
                    p.params.seed = self.params.seed.wrapping_add(i as u64);
                    p
                }
            })
            .collect()
    }
}

/// Checks sampling fields and the prompt (named `prompt_field` in errors); picks defaults.
pub fn prepare(
    state: &AppState,
    prompt: Vec<u32>,
    raw: RawSampling,
    prompt_field: &'static str,
) -> Result<Prepared, ApiError> {
    let info = &state.engine.info;
    let names = raw.names;
    let n = match raw.n.unwrap_or(1) {
        n if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
        n => {
            return Err(ApiError::invalid(
                format!("{} must be in 1..={MAX_CHOICES}, got {n}", names.n),
                Some(names.n),
            ))
        }
    };
    let room = info
        .context_len
        .min(info.kv_pages * info.page_size)
        .saturating_sub(prompt.len());
    let max_tokens = match raw.max_tokens {
        None => room.max(1),
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                format!("{} must be at least 1, got {m}", names.max_tokens),
                Some(names.max_tokens),
            ))
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
    };
    let temperature = raw.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("{} must be in [0, 2], got {temperature}", names.temperature),
            Some(names.temperature),
        ));
    }
    let top_p = raw.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("{} must be in (0, 1], got {top_p}", names.top_p),
            Some(names.top_p),
        ));
    }
    let top_k = match raw.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        k => {
            return Err(ApiError::invalid(
                format!(
                    "{} must be -1, 0 (every token) or positive, got {k}",
                    names.top_k
                ),
                Some(names.top_k),
            ))
        }
    };
    let min_p = raw.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid(
            format!("{} must be in [0, 1], got {min_p}", names.min_p),
            Some(names.min_p),
        ));
    }
    info.check(&prompt, max_tokens)
        .map_err(|m| ApiError::invalid(m, Some(prompt_field)))?;
    let id = state.engine.next_id();
    Ok(Prepared {
        id,
        prompt,
        params: SamplingParams {
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed: raw.seed.unwrap_or(id),
            stop_token_ids: raw.stop_token_ids.unwrap_or_default(),
            ignore_eos: raw.ignore_eos.unwrap_or(false),
            logprobs: raw.logprobs,
        },
        stops: raw.stop.map(Stop::into_vec).unwrap_or_default(),
        n,
        grammar: None,
    })
}

/// A request's place in the server's bound on outstanding requests, given back on drop.
pub struct Slot(Arc<AtomicUsize>);

impl Slot {
    /// A slot, or `None` if `limit` requests are already outstanding.
    fn take(count: &Arc<AtomicUsize>, limit: usize) -> Option<Slot> {
        let taken = count.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < limit).then_some(n + 1)
        });
        taken.ok().map(|_| Slot(count.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Queues `p`; its events arrive on the returned receiver (dropping it aborts the request).
/// 503 when the server already holds its limit of running plus waiting requests.
pub fn submit(
    state: &AppState,
    p: &Prepared,
    session: Option<String>,
) -> Result<(Slot, Receiver<Event>, Arc<AtomicBool>), ApiError> {
    state.accepting()?;
    let Some(slot) = Slot::take(&state.outstanding, state.max_outstanding) else {
        state.engine.metrics.requests_rejected.add(1);
        return Err(ApiError::with_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "queue_full",
            format!(
                "the server is full ({} requests running or waiting); retry later",
                state.max_outstanding
            ),
        ));
    };
    let constraint = (p.grammar.as_ref().map(Grammar::start).transpose())
        .map_err(|e| ApiError::invalid(e, Some("response_format")))?;
    tracing::info!(id = p.id, session = ?session, prompt_tokens = p.prompt.len(), "request");
    let (events, rx) = channel(EVENT_BUFFER);
    let ended_by_client = Arc::new(AtomicBool::new(false));
    state
        .engine
        .submit(Submission {
            id: p.id,
            prompt: p.prompt.clone(),
            params: p.params.clone(),
            session,
            events,
            ended_by_client: ended_by_client.clone(),
            constraint,
        })
        .map_err(|m| ApiError::with_status(StatusCode::SERVICE_UNAVAILABLE, "engine_stopped", m))?;
    Ok((slot, rx, ended_by_client))
}

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
    fn ended(&self) -> bool {
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

/// Runs `p` for a client: the pieces of its generation, whose text ends at `end_of_text`
/// (chat: the start of a tool-call section).
pub fn start(
    state: &AppState,
    p: &Prepared,
    session: Option<String>,
    end_of_text: Option<u32>,
) -> Result<Pieces, ApiError> {
    let (slot, rx, ended_by_client) = submit(state, p, session)?;
    let detok = Detokenizer::new(state.codec.clone(), p.stops.clone(), end_of_text);
    Ok(Pieces::new(
        slot,
        rx,
        state.deadline(),
        ended_by_client,
        detok,
        p.prompt.len(),
    ))
}

/// A server-sent-event response: `render` turns each piece into JSON chunks; `[DONE]` ends
/// it (OpenAI's and SGLang's streams). A client that goes away drops the stream, and with
/// it the request.
pub fn sse<F>(pieces: Pieces, mut render: F) -> axum::response::Response
where
    F: FnMut(Result<Piece, ApiError>, &[u32]) -> Vec<serde_json::Value> + Send + 'static,
{
    sse_choices(vec![pieces], move |_, piece, ids| render(piece, ids))
}

/// [`sse`] over several choices' generations at once: `render` gets each piece with its
/// choice's index, as pieces arrive.
pub fn sse_choices<F>(pieces: Vec<Pieces>, mut render: F) -> axum::response::Response
where
    F: FnMut(usize, Result<Piece, ApiError>, &[u32]) -> Vec<serde_json::Value> + Send + 'static,
{
    use axum::response::sse::Event as SseEvent;
    let done = SseEvent::default().data("[DONE]");
    event_stream(pieces, Some(done), move |i, piece, ids| {
        (render(i, piece, ids).iter())
            .map(|c| SseEvent::default().data(c.to_string()))
            .collect()
    })
}

/// A server-sent-event response of named events (Anthropic's stream: `event: NAME` then
/// its JSON), with nothing after the last.
pub fn named_sse<F>(pieces: Pieces, mut render: F) -> axum::response::Response
where
    F: FnMut(Result<Piece, ApiError>, &[u32]) -> Vec<(&'static str, serde_json::Value)>
        + Send
        + 'static,
{
    use axum::response::sse::Event as SseEvent;
    event_stream(vec![pieces], None, move |_, piece, ids| {
        (render(piece, ids).iter())
            .map(|(name, c)| SseEvent::default().event(*name).data(c.to_string()))
            .collect()
    })
}

/// The next piece of any choice still generating, with the choice's index; `None` once all
/// have ended. (`Pieces::next` keeps its state in the `Pieces`, so the futures of the
/// choices that lose the race are dropped without losing anything.)
async fn next_piece(pieces: &mut [Pieces]) -> Option<(usize, Result<Piece, ApiError>)> {
    loop {
        let live: Vec<_> = (pieces.iter_mut().enumerate())
            .filter(|(_, p)| !p.ended())
            .map(|(i, p)| Box::pin(async move { (i, p.next().await) }))
            .collect();
        if live.is_empty() {
            return None;
        }
        match futures_util::future::select_all(live).await.0 {
            (i, Some(piece)) => return Some((i, piece)),
            (_, None) => continue,
        }
    }
}

/// The events `render` makes of each piece of each choice (by index, as they arrive),
/// then `last`.
fn event_stream<F>(
    pieces: Vec<Pieces>,
    last: Option<axum::response::sse::Event>,
    render: F,
) -> axum::response::Response
where
    F: FnMut(usize, Result<Piece, ApiError>, &[u32]) -> Vec<axum::response::sse::Event>
        + Send
        + 'static,
{
    use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
    use axum::response::IntoResponse;
    let start = (pieces, render, VecDeque::<SseEvent>::new(), last, false);
    let stream = futures_util::stream::unfold(
        start,
        |(mut pieces, mut render, mut out, mut last, mut end)| async move {
            loop {
                if let Some(event) = out.pop_front() {
                    let event = Ok::<_, std::convert::Infallible>(event);
                    return Some((event, (pieces, render, out, last, end)));
                }
                if end {
                    return None;
                }
                match next_piece(&mut pieces).await {
                    Some((i, piece)) => {
                        let events = render(i, piece, pieces[i].ids());
                        out.extend(events);
                    }
                    None => {
                        out.extend(last.take());
                        end = true;
                    }
                }
            }
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
