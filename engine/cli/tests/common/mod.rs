//! What the binary's end-to-end tests share: a `kiln serve` process on a free port, and a
//! JSON POST.
// Each test binary uses part of it.
#![allow(dead_code)]
pub mod server;

use serde_json::Value;

/// POSTs a JSON `body` (with `Authorization: Bearer KEY` when given): the status and the
/// reply as JSON (or as a string when it is not JSON).
pub async fn post(url: &str, body: impl Into<reqwest::Body>, key: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.expect("an answer");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}
