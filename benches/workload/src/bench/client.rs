//! One streamed request to an LLM server, timed: SGLang's `/generate` with token ids, or
//! OpenAI `/v1/completions` with text.
//!
//! Both stream (SSE) so the time to the first token is measured on the wire. `/generate`
//! events carry cumulative `output_ids` and `meta_info` (`prompt_tokens`,
//! `completion_tokens`, `cached_tokens`, SGLang's `spec_verify_ct`); OpenAI chunks carry
//! incremental `choices[0].text` and, with `stream_options.include_usage`, a last chunk
//! with `usage` (`prompt_tokens_details.cached_tokens`). Every request asks for exactly
//! its output length (`ignore_eos`) and carries the session in `x-session-id` (and
//! `session_id` on `/generate`), so routers can keep a session on one replica.
use super::sse::SseParser;
use crate::metrics::RequestRecord;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// How prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// SGLang-style `POST /generate` with `input_ids`.
    Generate,
    /// OpenAI `POST /v1/completions` with a text prompt.
    Text,
}

impl Api {
    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Api::Generate => "generate",
            Api::Text => "text",
        }
    }
}

/// A prompt in the form the API takes.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Token ids (`/generate`).
    Ids(Vec<u32>),
    /// Text (`/v1/completions`).
    Text(String),
}

/// What the model wrote, in the prompt's form (appended to the session's history).
pub type Output = Prompt;

/// An HTTP client bound to one server, API and model.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    /// Model name sent with OpenAI requests.
    pub model: String,
    /// The API in use.
    pub api: Api,
    temperature: f64,
}

impl Client {
    /// A client for `base` (e.g. `http://127.0.0.1:30000`), with a per-request timeout.
    pub fn new(
        base: &str,
        api: Api,
        model: String,
        temperature: f64,
        timeout: Duration,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(1024)
            .build()?;
        let base = base.trim_end_matches('/').to_string();
        Ok(Self {
            http,
            base,
            model,
            api,
            temperature,
        })
    }

    /// Sends one request and waits for its last token. Failures are recorded in the
    /// record's `error`, never returned: a benchmark counts them and goes on.
    pub async fn complete(
        &self,
        prompt: &Prompt,
        max_new_tokens: u32,
        session_id: Option<&str>,
        point_start: Instant,
    ) -> (RequestRecord, Output) {
        let sent = Instant::now();
        let mut state = StreamState::new(self.api, prompt);
        let result = self
            .stream(prompt, max_new_tokens, session_id, sent, &mut state)
            .await;
        let e2e_s = sent.elapsed().as_secs_f64();
        let record = RequestRecord {
            start_s: sent.duration_since(point_start).as_secs_f64(),
            ttft_s: state.ttft_s,
            e2e_s,
            prompt_tokens: state.prompt_tokens.unwrap_or(state.prompt_len),
            completion_tokens: state.completion_tokens,
            cached_tokens: state.cached_tokens,
            spec_verify_ct: state.spec_verify_ct,
            error: result.err(),
        };
        (record, state.output)
    }

    async fn stream(
        &self,
        prompt: &Prompt,
        max_new_tokens: u32,
        session_id: Option<&str>,
        sent: Instant,
        state: &mut StreamState,
    ) -> Result<(), String> {
        let (path, body) = self.body(prompt, max_new_tokens, session_id);
        let mut req = self.http.post(format!("{}{path}", self.base)).json(&body);
        if let Some(s) = session_id {
            req = req.header("x-session-id", s);
        }
        let resp = req.send().await.map_err(|e| format!("{path}: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("{path}: HTTP {status}: {}", snippet(&text)));
        }
        let mut sse = SseParser::default();
        let mut body = resp.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| format!("{path}: {e}"))?;
            for data in sse.push(&chunk) {
                state.on_data(&data, sent.elapsed().as_secs_f64())?;
            }
        }
        if let Some(data) = sse.finish() {
            state.on_data(&data, sent.elapsed().as_secs_f64())?;
        }
        if !state.done {
            return Err(format!("{path}: stream ended without [DONE]"));
        }
        Ok(())
    }

    fn body(
        &self,
        prompt: &Prompt,
        max_new_tokens: u32,
        session_id: Option<&str>,
    ) -> (&'static str, Value) {
        match (self.api, prompt) {
            (Api::Generate, Prompt::Ids(ids)) => {
                let mut body = json!({
                    "input_ids": ids,
                    "sampling_params": {
                        "max_new_tokens": max_new_tokens,
                        "temperature": self.temperature,
                        "ignore_eos": true,
                    },
                    "stream": true,
                });
                if let Some(s) = session_id {
                    body["session_id"] = json!(s);
                }
                ("/generate", body)
            }
            (_, prompt) => {
                let prompt = match prompt {
                    Prompt::Text(t) => json!(t),
                    Prompt::Ids(ids) => json!(ids),
                };
                let body = json!({
                    "model": self.model,
                    "prompt": prompt,
                    "max_tokens": max_new_tokens,
                    "temperature": self.temperature,
                    "ignore_eos": true,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                ("/v1/completions", body)
            }
        }
    }

    /// Asks `/generate` for one token: true when the server has the endpoint.
    pub async fn has_generate(&self, token: u32) -> bool {
        let body = json!({"input_ids": [token], "sampling_params": {"max_new_tokens": 1}});
        let resp = self
            .http
            .post(format!("{}/generate", self.base))
            .json(&body)
            .send()
            .await;
        resp.is_ok_and(|r| r.status().is_success())
    }

    /// The first model the server lists at `/v1/models` (`None` if it lists none or has
    /// no such endpoint); an error when the server can't be reached at all.
    pub async fn first_model(&self) -> Result<Option<ListedModel>, String> {
        let url = format!("{}/v1/models", self.base);
        let resp = self
            .http
            .get(&url)
            .send()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let v: Value = resp.json().await.unwrap_or_default();
        let model = &v["data"][0];
        Ok(model["id"].as_str().map(|id| ListedModel {
            id: id.to_string(),
            max_model_len: model["max_model_len"].as_u64().map(|n| n as u32),
        }))
    }

    /// The server's Prometheus text at `/metrics`, if it has one.
    pub async fn metrics(&self) -> Option<String> {
        let resp = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.text().await.ok()
    }
}

/// A model as `/v1/models` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedModel {
    /// Its name.
    pub id: String,
    /// Its context length (prompt plus output), where the server says (kiln, vLLM).
    pub max_model_len: Option<u32>,
}

/// What the events of one response have said so far.
#[derive(Debug)]
struct StreamState {
    api: Api,
    prompt_len: u64,
    ttft_s: Option<f64>,
    prompt_tokens: Option<u64>,
    completion_tokens: u64,
    cached_tokens: Option<u64>,
    spec_verify_ct: Option<u64>,
    output: Output,
    done: bool,
}

impl StreamState {
    fn new(api: Api, prompt: &Prompt) -> Self {
        let (prompt_len, output) = match prompt {
            Prompt::Ids(ids) => (ids.len() as u64, Prompt::Ids(Vec::new())),
            Prompt::Text(t) => (
                t.split_whitespace().count() as u64,
                Prompt::Text(String::new()),
            ),
        };
        Self {
            api,
            prompt_len,
            ttft_s: None,
            prompt_tokens: None,
            completion_tokens: 0,
            cached_tokens: None,
            spec_verify_ct: None,
            output,
            done: false,
        }
    }

    /// One SSE payload, received `t` seconds after sending.
    fn on_data(&mut self, data: &str, t: f64) -> Result<(), String> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value =
            serde_json::from_str(data).map_err(|e| format!("bad event {}: {e}", snippet(data)))?;
        if let Some(err) = v.get("error") {
            return Err(format!("server error: {}", snippet(&err.to_string())));
        }
        match self.api {
            Api::Generate => self.on_generate(&v),
            Api::Text => self.on_completion_chunk(&v),
        }
        if self.ttft_s.is_none() && self.completion_tokens > 0 {
            self.ttft_s = Some(t);
        }
        Ok(())
    }

    /// `/generate` event: cumulative `output_ids` and `meta_info` (an incremental server,
    /// whose `output_ids` is shorter than `completion_tokens`, is appended instead).
    fn on_generate(&mut self, v: &Value) {
        let meta = &v["meta_info"];
        let ids: Vec<u32> = v["output_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default();
        let reported = meta["completion_tokens"].as_u64();
        if let Prompt::Ids(out) = &mut self.output {
            if reported.is_none_or(|n| n as usize == ids.len()) {
                *out = ids;
            } else {
                out.extend(ids);
            }
            self.completion_tokens = reported.unwrap_or(out.len() as u64);
        }
        self.prompt_tokens = meta["prompt_tokens"].as_u64().or(self.prompt_tokens);
        self.cached_tokens = meta["cached_tokens"].as_u64().or(self.cached_tokens);
        self.spec_verify_ct = meta["spec_verify_ct"].as_u64().or(self.spec_verify_ct);
    }

    /// OpenAI completion chunk: incremental text, and `usage` on the last one.
    fn on_completion_chunk(&mut self, v: &Value) {
        if let (Some(text), Prompt::Text(out)) =
            (v["choices"][0]["text"].as_str(), &mut self.output)
        {
            if !text.is_empty() {
                out.push_str(text);
                // Chunks before `usage` count one token each (servers stream one per chunk).
                self.completion_tokens += 1;
            }
        }
        let usage = &v["usage"];
        if let Some(n) = usage["completion_tokens"].as_u64() {
            self.completion_tokens = n;
        }
        self.prompt_tokens = usage["prompt_tokens"].as_u64().or(self.prompt_tokens);
        let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
        self.cached_tokens = cached.or(self.cached_tokens);
    }
}

/// The first 200 characters of `s`, for error messages.
fn snippet(s: &str) -> String {
    s.chars().take(200).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cumulative_generate_events_replace_the_output_and_time_the_first_token() {
        let mut s = StreamState::new(Api::Generate, &Prompt::Ids(vec![1, 2, 3]));
        s.on_data(
            r#"{"text":"","output_ids":[],"meta_info":{"completion_tokens":0}}"#,
            0.1,
        )
        .unwrap();
        assert_eq!(s.ttft_s, None);
        s.on_data(
            r#"{"text":"a","output_ids":[7],"meta_info":{"completion_tokens":1}}"#,
            0.5,
        )
        .unwrap();
        let last = r#"{"text":"ab","output_ids":[7,8],"meta_info":{"prompt_tokens":3,"completion_tokens":2,"cached_tokens":2,"spec_verify_ct":1}}"#;
        s.on_data(last, 0.9).unwrap();
        s.on_data("[DONE]", 0.9).unwrap();
        assert_eq!(s.ttft_s, Some(0.5));
        assert_eq!(s.output, Prompt::Ids(vec![7, 8]));
        assert_eq!(
            (s.prompt_tokens, s.completion_tokens, s.cached_tokens),
            (Some(3), 2, Some(2))
        );
        assert_eq!(s.spec_verify_ct, Some(1));
        assert!(s.done);
    }

    #[test]
    fn incremental_generate_events_are_appended() {
        let mut s = StreamState::new(Api::Generate, &Prompt::Ids(vec![1]));
        s.on_data(
            r#"{"output_ids":[7],"meta_info":{"completion_tokens":1}}"#,
            0.1,
        )
        .unwrap();
        s.on_data(
            r#"{"output_ids":[8],"meta_info":{"completion_tokens":2}}"#,
            0.2,
        )
        .unwrap();
        assert_eq!(s.output, Prompt::Ids(vec![7, 8]));
    }

    #[test]
    fn completion_chunks_accumulate_text_and_take_usage_last() {
        let mut s = StreamState::new(Api::Text, &Prompt::Text(" a b".into()));
        s.on_data(r#"{"choices":[{"text":" x"}]}"#, 0.2).unwrap();
        s.on_data(r#"{"choices":[{"text":" y"}]}"#, 0.3).unwrap();
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}}}"#;
        s.on_data(usage, 0.3).unwrap();
        assert_eq!(s.output, Prompt::Text(" x y".into()));
        assert_eq!(
            (s.ttft_s, s.completion_tokens, s.cached_tokens),
            (Some(0.2), 2, Some(1))
        );
    }

    #[test]
    fn an_error_event_fails_the_request() {
        let mut s = StreamState::new(Api::Text, &Prompt::Text("a".into()));
        let err = s
            .on_data(r#"{"error":{"message":"context too long"}}"#, 0.1)
            .unwrap_err();
        assert!(err.contains("context too long"), "{err}");
    }
}
