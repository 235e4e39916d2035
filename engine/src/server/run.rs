//! One generation as the endpoints share it: sampling parameters checked, the prompt
//! checked against the model, the request queued (or refused with 503 when the queue is
//! full), and its [`Pieces`] streamed to the client as server-sent events.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use serde::Deserialize;
use tokio::sync::mpsc::{channel, Receiver};

use super::detok::Detokenizer;
use super::error::ApiError;
use super::grammar::Grammar;
use super::pieces::{Piece, Pieces};
use super::AppState;
use crate::scheduler::{Event, SamplingParams, Submission, EVENT_BUFFER};

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
