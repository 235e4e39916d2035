//! The HTTP server: OpenAI-compatible endpoints (chat, completions, responses), Anthropic's
//! Messages API, SGLang's `/generate`, health, models and Prometheus metrics, in front of
//! one engine thread.
//!
//! Every request is parsed and checked here (a bad one gets an OpenAI-format 4xx and never
//! reaches the engine: unknown fields and fields the server cannot honour are refused, not
//! ignored), then queued; tokens stream back as the engine makes them. The session header
//! (`kiln_core::session`) is logged with each request (the router keys affinity on it). Tokenizing and chat
//! rendering run on a bounded pool of blocking threads, so `/health` and small requests
//! never wait behind a large prompt. On shutdown the server drains ([`AppState::drain`]):
//! `/health` and new requests get 503, requests in flight finish or, past the deadline,
//! end with an error event.
mod anthropic;
mod call_stream;
mod chat_format;
mod chat_template;
mod choices;
mod detok;
mod error;
mod fields;
mod generate;
mod grammar;
mod logprobs;
mod openai;
mod pieces;
mod reasoning;
mod responses;
mod run;
mod tojson;
mod tools;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::{watch, Semaphore};

pub use chat_format::{ChatMessage, KimiFormat};
pub use chat_template::{ChatTemplate, KIMI_TEMPLATE};
pub use error::ApiError;
use grammar::Grammars;
pub use reasoning::ThinkTokens;

use crate::engine::EngineHandle;
use crate::model::tokenizer::TextCodec;

/// The structured-output grammars of a model: llguidance over its vocabulary, whose end is
/// the model's first end-of-sequence id.
fn grammars(codec: &Arc<TextCodec>, info: &crate::engine::ModelInfo) -> Option<Grammars> {
    let end = *info.eos_token_ids.first()?;
    Grammars::new(codec.clone(), info.vocab_size, end)
        .inspect_err(|e| tracing::warn!("structured outputs unavailable: {e}"))
        .ok()
}

/// Largest request body: a 100k-token prompt as JSON ids or text fits with room to spare.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub codec: Arc<TextCodec>,
    /// How chats become prompts: the checkpoint's template (or Kimi's, for a tokenizer with
    /// Kimi's chat tokens and no template); without one the chat endpoints refuse.
    pub template: Option<ChatTemplate>,
    /// Kimi's chat tokens, if the tokenizer has them: where a reply's turn ends and how
    /// its tool calls are written.
    pub chat: Option<KimiFormat>,
    /// A thinking model's think tokens: its replies' reasoning is split from the answer.
    pub think: Option<ThinkTokens>,
    /// Grammars over the vocabulary, for structured outputs (`None` if llguidance could
    /// not take the vocabulary).
    pub grammars: Option<Grammars>,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Requests the server holds at once (running plus waiting); beyond it new ones get 503.
    pub max_outstanding: usize,
    /// Requests held now (each releases its slot when its generation is dropped).
    pub outstanding: Arc<AtomicUsize>,
    /// Tokenizations running at once on the blocking pool: one core short of all of them,
    /// so the async workers and the engine keep one (the rest wait their turn off the
    /// async workers).
    tokenizing: Semaphore,
    /// The most bytes one token covers: a text longer than the context times this cannot
    /// fit, and is refused before it is tokenized.
    max_token_bytes: usize,
    /// Set when the server drains for shutdown.
    draining: AtomicBool,
    /// Turns `true` when draining's deadline passes: streams still running end then.
    deadline: watch::Sender<bool>,
}

pub type SharedState = Arc<AppState>;

impl AppState {
    /// The state of a server over `engine`; `api_key` must not be empty (`Some("")` would
    /// refuse every call).
    pub fn new(
        engine: EngineHandle,
        codec: Arc<TextCodec>,
        template: Option<ChatTemplate>,
        chat: Option<KimiFormat>,
        model_name: String,
        api_key: Option<String>,
        max_outstanding: usize,
    ) -> Self {
        assert!(
            api_key.as_ref().is_none_or(|k| !k.is_empty()),
            "empty API key"
        );
        let threads =
            std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
        AppState {
            max_token_bytes: codec.max_token_bytes(),
            think: ThinkTokens::find(&codec),
            grammars: grammars(&codec, &engine.info),
            engine,
            codec,
            template,
            chat,
            model_name,
            api_key,
            max_outstanding,
            outstanding: Default::default(),
            tokenizing: Semaphore::new(threads),
            draining: AtomicBool::new(false),
            deadline: watch::channel(false).0,
        }
    }

    /// Runs `work` (tokenizing, chat rendering) on the blocking pool, at most one per core
    /// at a time. `text_bytes` is checked against the context first: a text of more bytes
    /// than the context's tokens can cover is refused without tokenizing it.
    async fn tokenize<T: Send + 'static>(
        &self,
        text_bytes: usize,
        field: &'static str,
        work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let limit = self.engine.info.context_len;
        if text_bytes > limit.saturating_mul(self.max_token_bytes) {
            return Err(ApiError::invalid(
                format!(
                    "this model's maximum context length is {limit} tokens; the {field} has                      {text_bytes} bytes, more than that many tokens can hold"
                ),
                Some(field),
            ));
        }
        let _permit = self.tokenizing.acquire().await.expect("never closed");
        tokio::task::spawn_blocking(work).await.map_err(|e| {
            ApiError::with_status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "tokenizer",
                e.to_string(),
            )
        })?
    }

    /// Token ids of a prompt text, off the async workers.
    async fn encode(&self, text: String, field: &'static str) -> Result<Vec<u32>, ApiError> {
        let codec = self.codec.clone();
        self.tokenize(text.len(), field, move || {
            codec.encode(&text).map_err(|e| {
                ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some(field))
            })
        })
        .await
    }

    /// Whether the server is draining for shutdown.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// 503 while draining: no new work.
    fn accepting(&self) -> Result<(), ApiError> {
        if self.is_draining() {
            self.rejected();
            return Err(ApiError::draining());
        }
        Ok(())
    }

    /// A receiver that turns `true` when draining's deadline passes.
    fn deadline(&self) -> watch::Receiver<bool> {
        self.deadline.subscribe()
    }

    /// Drains for shutdown: new requests and `/health` get 503 from now on; waits up to
    /// `timeout` for the requests in flight to finish, then ends the rest (each stream gets
    /// an error event saying why). Returns how many were in flight and how many were cut.
    pub async fn drain(&self, timeout: Duration) -> (usize, usize) {
        self.draining.store(true, Ordering::Release);
        let in_flight = self.outstanding.load(Ordering::Acquire);
        tracing::info!(in_flight, timeout_s = timeout.as_secs_f64(), "draining");
        let start = Instant::now();
        while self.outstanding.load(Ordering::Acquire) > 0 && start.elapsed() < timeout {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cut = self.outstanding.load(Ordering::Acquire);
        if cut > 0 {
            let _ = self.deadline.send(true);
            // Give the streams a moment to write their error events.
            let grace = Instant::now();
            while self.outstanding.load(Ordering::Acquire) > 0
                && grace.elapsed() < Duration::from_secs(2)
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        tracing::info!(
            finished = in_flight.saturating_sub(cut),
            cut,
            ms = start.elapsed().as_millis() as u64,
            "drained"
        );
        (in_flight, cut)
    }

    /// Requests name the served model or none; anything else is a 404 as in OpenAI's API.
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if !m.is_empty() && m != self.model_name => {
                self.rejected();
                Err(ApiError::with_status(
                    StatusCode::NOT_FOUND,
                    "model_not_found",
                    format!(
                        "the model `{m}` does not exist; this server serves `{}`",
                        self.model_name
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    fn rejected(&self) {
        self.engine.metrics.requests_rejected.add(1);
    }
}

/// The session the request names (`x-session-id`, or an agent's own header), if any.
fn session_id(headers: &HeaderMap) -> Option<String> {
    kiln_core::session::session_of(|name| headers.get(name).and_then(|v| v.to_str().ok()))
        .map(str::to_string)
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The routes: the API behind the key check (when a key is set), health and metrics open.
/// Every error, 404, 405 and 415 included, is OpenAI's error body.
pub fn router(state: SharedState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/completions", post(openai::completions))
        .route("/generate", post(generate::generate))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::with_status(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::with_status(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "this endpoint does not take that method (the API's endpoints are POST, \
                 /v1/models, /health and /metrics are GET)",
            )
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The key of `Authorization: Bearer KEY`, the scheme in any case (RFC 9110 section 11.1).
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, key) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

async fn require_key(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        // Anthropic's clients send the key as `x-api-key`.
        let anthropic = || req.headers().get("x-api-key")?.to_str().ok().map(str::trim);
        if bearer(req.headers()).or_else(anthropic) != Some(key.as_str()) {
            state.rejected();
            return ApiError::with_status(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "missing or wrong API key (send `Authorization: Bearer KEY` or `x-api-key: KEY`)",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// 200 while the engine thread runs; 503 while draining for shutdown or once the engine
/// has died (so a router takes the replica out of rotation).
async fn health(State(state): State<SharedState>) -> Response {
    if state.is_draining() {
        ApiError::draining().into_response()
    } else if state.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::with_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "engine_stopped",
            "the engine thread has stopped; see the server's log",
        )
        .into_response()
    }
}

fn model_card(state: &AppState) -> serde_json::Value {
    json!({
        "id": state.model_name, "object": "model", "created": unix_time(), "owned_by": "kiln",
        "max_model_len": state.engine.info.context_len,
    })
}

async fn models(State(state): State<SharedState>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [model_card(&state)]}))
}

/// `GET /v1/models/{id}` (the OpenAI client's `models.retrieve`).
async fn model(
    State(state): State<SharedState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.check_model(Some(&id))?;
    Ok(Json(model_card(&state)))
}

async fn metrics(State(state): State<SharedState>) -> impl IntoResponse {
    let mut text = state.engine.metrics.render();
    text.push_str(&format!(
        "# HELP kiln_draining 1 while the server drains for shutdown (routers stop sending).\n\
         # TYPE kiln_draining gauge\nkiln_draining {}\n",
        u8::from(state.is_draining())
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, v.parse().unwrap());
            bearer(&h).map(str::to_string)
        };
        assert_eq!(with("Bearer k1").as_deref(), Some("k1"));
        assert_eq!(with("bearer k1").as_deref(), Some("k1"));
        assert_eq!(with("BEARER  k1 ").as_deref(), Some("k1"));
        assert_eq!(with("Basic k1"), None);
        assert_eq!(with("k1"), None);
    }
}
