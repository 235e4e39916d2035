//! What the binary's end-to-end tests share: a `kiln serve` process on a free port, and a
//! JSON POST.
// Each test binary uses part of it.
#![allow(dead_code)]
pub mod server;

use std::path::Path;

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

/// POSTs a JSON `body` and returns the reply's text whole (a stream read to its end).
pub async fn post_text(url: &str, body: &Value) -> String {
    reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .expect("an answer")
        .text()
        .await
        .expect("a body")
}

/// A server-sent-event body of named events as (name, JSON data) pairs, keep-alive
/// comments skipped.
pub fn named_events(text: &str) -> Vec<(String, Value)> {
    let mut events = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let field = |f: &str| {
            block
                .lines()
                .find_map(|l| l.strip_prefix(f))
                .map(str::trim_start)
        };
        if let (Some(name), Some(data)) = (field("event:"), field("data:")) {
            let data = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            events.push((name.to_string(), data));
        }
    }
    events
}

/// Runs a Python `script` with `url` as its argument, which must print `ok` first; the
/// SDK it imports (`module`, pinned by .ci/setup as `pin`) is named if missing.
pub fn run_python_client(script: &str, url: &str, module: &str, pin: &str) {
    let out = std::process::Command::new("python3")
        .args(["-c", script, url])
        .output()
        .expect("python3 runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains(&format!("No module named '{module}'")),
        "the {module} SDK is missing: run .ci/setup (pip install {pin})"
    );
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok"));
}

/// The embedded tiny model made to follow a script: after token `t` it generates
/// `next(t % hidden)` (greedy). Embeddings are one-hot (token `t` at dimension `t % hidden`)
/// and every block's output projections zero, so the final hidden state is the last
/// token's embedding, normalized; `lm_head` maps each dimension to its successor.
pub fn scripted_model(dir: &Path, next: impl Fn(usize) -> usize) {
    kiln::model::default_model::write(dir).expect("default model");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let bf16 = |v: bool| half::bf16::from_f32(if v { 1.0 } else { 0.0 }).to_le_bytes();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let shape = view.shape().to_vec();
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let cells = (0..rows).flat_map(|r| (0..cols).map(move |c| (r, c)));
            let data: Vec<u8> = if name == "model.embed_tokens.weight" {
                cells.flat_map(|(t, d)| bf16(t % cols == d)).collect()
            } else if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                vec![0; view.data().len()]
            } else if name == "lm_head.weight" {
                cells.flat_map(|(t, d)| bf16(next(d) == t)).collect()
            } else {
                view.data().to_vec()
            };
            (name, shape, data)
        })
        .collect();
    let views = tensors.iter().map(|(name, shape, data)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data)
                .unwrap();
        (name.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &path).unwrap();
}
