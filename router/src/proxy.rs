//! The reverse proxy: every request except the router's own `/metrics` and `/health`
//! goes to the replica the placer picks, and the response streams back untouched.
//!
//! The body is read once (to find the session key and to be able to retry), then sent
//! with the client's method, path, query and headers (hop-by-hop headers dropped). The
//! response's status, headers and body bytes pass through as they arrive, so SSE
//! streams stay streams. A request that fails before its first response byte (refused
//! or reset connection, or a 502/503 from the replica) is retried once on another
//! replica; a refused connection also drains the replica until a health check passes.
//! A response that breaks off after its first byte cannot be retried: an event stream
//! then ends with an SSE error event (and `[DONE]`), any other body with the error, so the
//! client is told rather than left with a silent truncation. The request counts as in
//! flight on its replica until its response body ends or the client goes away. The
//! router's own errors are OpenAI's error body (`message`, `type`, `param`, `code`).

use crate::placer::Placer;
use crate::replicas::ReplicaSource;
use crate::session::{session_key, SessionKey};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::StreamExt;
use kiln_core::session::session_of;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Largest request body the router reads (a 256k-token prompt as JSON ids is ~2 MB).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// Shared state of a running router.
#[derive(Debug)]
pub struct AppState {
    /// Placement state.
    pub placer: Mutex<Placer>,
    /// HTTP client for replicas (pooled connections).
    pub client: reqwest::Client,
    /// Where the replica list comes from.
    pub source: ReplicaSource,
    started: Instant,
}

impl AppState {
    /// State over `placer`, with replicas from `source` loaded at time 0.
    pub fn new(placer: Placer, source: ReplicaSource) -> Result<Self, crate::RouterError> {
        let client = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(2))
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()?;
        let state = Self {
            placer: Mutex::new(placer),
            client,
            source,
            started: Instant::now(),
        };
        state.reload()?;
        Ok(state)
    }

    /// Milliseconds since the router started (the placer's clock).
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The placer, even if a panicking request poisoned its lock (its state is counters
    /// and maps that every update leaves consistent).
    pub fn placer(&self) -> MutexGuard<'_, Placer> {
        self.placer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Re-reads the replica list and applies it; returns the number of replicas.
    pub fn reload(&self) -> Result<usize, crate::RouterError> {
        let list = self.source.load()?;
        let now = self.now_ms();
        self.placer().set_replicas(&list, now);
        Ok(list.len())
    }
}

/// The router's HTTP app.
pub fn app(state: Arc<AppState>) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .fallback(proxy)
        .with_state(state)
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let text = crate::metrics::render(&state.placer());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let up = state.placer().replicas().iter().filter(|r| r.up).count();
    let status = if up > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, format!("{up} replicas up\n")).into_response()
}

/// Ends a request's in-flight count when dropped (response done or client gone).
struct InFlight {
    state: Arc<AppState>,
    key: Option<SessionKey>,
    replica: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.placer().finish(self.key, self.replica);
    }
}

async fn proxy(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(err) => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("cannot read the request body: {err}"),
            )
        }
    };
    let header = session_of(|name| parts.headers.get(name).and_then(|v| v.to_str().ok()));
    let key = session_key(header, &body);
    let mut exclude = None;
    for attempt in 0..2 {
        let now = state.now_ms();
        let Some((replica, base)) = ({
            let mut placer = state.placer();
            placer
                .place(key, now, exclude)
                .map(|p| (p.replica, placer.replica(p.replica).map(|r| r.name.clone())))
        }) else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "no healthy replica");
        };
        let guard = InFlight {
            state: state.clone(),
            key,
            replica,
        };
        let base = base.expect("placed on a known replica");
        let sent = forward(
            &state.client,
            &base,
            &parts.method,
            &parts.uri,
            &parts.headers,
            body.clone(),
        )
        .await;
        let retryable = match &sent {
            Ok(response) => matches!(response.status().as_u16(), 502 | 503),
            Err(err) => {
                if err.is_connect() {
                    tracing::warn!(replica = %base, "connection failed, draining: {err}");
                    state.placer().set_up(replica, false);
                }
                true
            }
        };
        if retryable && attempt == 0 {
            drop(guard);
            state.placer().record_retry();
            exclude = Some(replica);
            continue;
        }
        return match sent {
            Ok(response) => stream_back(response, guard, state.clone(), base),
            Err(err) => error(
                StatusCode::BAD_GATEWAY,
                &format!("replica {base} failed: {err}"),
            ),
        };
    }
    unreachable!("the second attempt always returns")
}

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1).
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

async fn forward(
    client: &reqwest::Client,
    base: &str,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<reqwest::Response, reqwest::Error> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut outgoing = HeaderMap::with_capacity(headers.len());
    for (name, value) in headers
        .iter()
        .filter(|(n, _)| !hop_by_hop(n) && *n != header::CONTENT_LENGTH)
    {
        outgoing.append(name.clone(), value.clone());
    }
    client
        .request(method.clone(), format!("{base}{path}"))
        .headers(outgoing)
        .body(body)
        .send()
        .await
}

fn stream_back(
    response: reqwest::Response,
    guard: InFlight,
    state: Arc<AppState>,
    base: String,
) -> Response {
    let mut builder = Response::builder().status(response.status());
    for (name, value) in response.headers().iter().filter(|(n, _)| !hop_by_hop(n)) {
        builder = builder.header(name, value);
    }
    let sse = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // Chunks as they come; a failed read ends the body with an error the client can see.
    let start = Some((response.bytes_stream(), guard, state, base));
    let stream = futures_util::stream::unfold(start, move |alive| async move {
        let (mut bytes, guard, state, base) = alive?;
        match bytes.next().await {
            Some(Ok(chunk)) => Some((
                Ok::<_, std::io::Error>(chunk),
                Some((bytes, guard, state, base)),
            )),
            None => None,
            Some(Err(err)) => {
                tracing::warn!(replica = %base, "response broke off mid-body: {err}");
                state.placer().record_broken_stream();
                let body = error_body(
                    StatusCode::BAD_GATEWAY,
                    "replica_stream_broken",
                    &format!("replica {base} broke off the response: {err}"),
                );
                let tail = if sse {
                    format!("data: {body}\n\ndata: [DONE]\n\n")
                } else {
                    body.to_string()
                };
                Some((Ok(Bytes::from(tail)), None))
            }
        }
    });
    builder
        .body(Body::from_stream(stream))
        .unwrap_or_else(|err| error(StatusCode::BAD_GATEWAY, &err.to_string()))
}

/// OpenAI's error body: `type` says whose fault, `code` what happened.
fn error_body(status: StatusCode, code: &str, message: &str) -> serde_json::Value {
    let kind = match status.as_u16() {
        503 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

fn error(status: StatusCode, message: &str) -> Response {
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "no_healthy_replica",
        _ => "replica_failed",
    };
    (status, axum::Json(error_body(status, code, message))).into_response()
}
