//! Errors in OpenAI's format (`{"error": {"message", "type", "param", "code"}}`) with the
//! HTTP status that says whose fault it is, and a JSON extractor whose rejections (bad JSON,
//! wrong content type, a body over the limit) come out the same way.
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: &'static str,
    /// The request field at fault, as a path (`messages[2].content`).
    pub param: Option<String>,
}

impl ApiError {
    /// 400: the request is wrong.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            code: "invalid_request_error",
            param: param.map(str::to_string),
        }
    }

    pub fn with_status(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            code,
            param: None,
        }
    }

    /// 400 for a field the server does not honour (rather than ignoring it silently).
    pub fn unsupported(field: &str, why: impl std::fmt::Display) -> Self {
        ApiError::invalid(format!("{field}: {why}"), Some(field))
    }

    /// 503: the server is draining for shutdown and takes no new requests.
    pub fn draining() -> Self {
        ApiError::with_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            "the server is shutting down and takes no new requests; retry on another replica",
        )
    }

    /// OpenAI's error `type` for the status: the client's fault, or the server's.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            503 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The `{"error": {...}}` body, as responses and stream error events carry it.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(from_rejection(rejection)),
        }
    }
}

fn from_rejection(r: JsonRejection) -> ApiError {
    let status = r.status();
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        _ => "invalid_request_error",
    };
    // 422 (valid JSON, wrong shape) is a 400 in OpenAI's API.
    let status = if status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        status
    };
    ApiError::with_status(status, code, r.body_text())
}
