//! The HTTP server: OpenAI-compatible endpoints, SGLang's `/generate`, health, models and
//! Prometheus metrics, in front of one engine thread.
//!
//! Every request is parsed and checked here (a bad one gets an OpenAI-format 4xx and never
//! reaches the engine), then queued; tokens stream back as the engine makes them. The
//! `x-session-id` header is logged with each request (the router keys affinity on it).
mod chat_format;
mod detok;
mod error;
mod generate;
mod openai;
mod run;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

pub use chat_format::{ChatMessage, KimiFormat};
pub use error::ApiError;

use crate::engine::EngineHandle;
use crate::model::tokenizer::TextCodec;

/// Largest request body: a 100k-token prompt as JSON ids or text fits with room to spare.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub codec: Arc<TextCodec>,
    /// Kimi's chat format over the tokenizer, if it has the chat tokens.
    pub chat: Option<KimiFormat>,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Requests the server holds at once (running plus waiting); beyond it new ones get 503.
    pub max_outstanding: usize,
    /// Requests held now (each releases its slot when its generation is dropped).
    pub outstanding: Arc<AtomicUsize>,
}

pub type SharedState = Arc<AppState>;

impl AppState {
    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.codec.encode(text).map_err(|e| {
            ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt"))
        })
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

/// The `x-session-id` header, if any.
fn session_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The routes: the API behind the key check (when a key is set), health and metrics open.
pub fn router(state: SharedState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/generate", post(generate::generate))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::with_status(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn require_key(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key.as_str()) {
            state.rejected();
            return ApiError::with_status(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "missing or wrong API key (send `Authorization: Bearer KEY`)",
            )
            .into_response();
        }
    }
    next.run(req).await
}

/// 200 while the engine thread runs, 503 once it has died (so a router drains the replica).
async fn health(State(state): State<SharedState>) -> Response {
    if state.engine.is_alive() {
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

async fn models(State(state): State<SharedState>) -> Json<serde_json::Value> {
    Json(json!({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": unix_time(), "owned_by": "kiln",
        "max_model_len": state.engine.info.context_len,
    }]}))
}

async fn metrics(State(state): State<SharedState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.engine.metrics.render(),
    )
}
