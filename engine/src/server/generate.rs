//! SGLang's native `POST /generate`: token ids in (`input_ids`, or `text`), token ids out
//! (`output_ids`), with `meta_info` counting prompt, cached and completion tokens. When
//! streaming, every event carries the text and ids so far (SGLang's default), then
//! `data: [DONE]`.
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{ApiError, ApiJson};
use super::fields::{refuse_unsupported, SGLANG_SAMPLING};
use super::logprobs::with_logprobs;
use super::pieces::{Outcome, Piece};
use super::run::{prepare, sse, start, RawSampling, Stop, MAX_TOP_LOGPROBS, SGLANG_NAMES};
use super::{session_id, SharedState};

#[derive(Deserialize, Default)]
pub struct SamplingFields {
    max_new_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    n: Option<i64>,
    /// Every other field: refused unless left off (see `fields`).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
pub struct GenerateRequest {
    input_ids: Option<Vec<u32>>,
    text: Option<String>,
    #[serde(default)]
    sampling_params: SamplingFields,
    #[serde(default)]
    stream: bool,
    /// SGLang's session field; the `x-session-id` header takes precedence.
    session_id: Option<String>,
    /// Checked like OpenAI's: the served model or none.
    model: Option<String>,
    /// Each generated token's log-probability in `meta_info.output_token_logprobs`
    /// (`[logprob, id, null]`), and with `top_logprobs_num` the most likely alternatives in
    /// `meta_info.output_top_logprobs`, as SGLang returns them.
    #[serde(default)]
    return_logprob: bool,
    #[serde(default)]
    top_logprobs_num: usize,
    /// Every other field: refused unless harmless (see `fields`).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

fn body(
    id: &str,
    text: &str,
    ids: &[u32],
    prompt: usize,
    cached: usize,
    end: Option<&Outcome>,
) -> Value {
    let finish = end.map(|o| json!({"type": o.reason.as_str()}));
    let cached = end.map_or(cached, |o| o.usage.cached_tokens);
    let mut b = meta(id, text, ids, prompt, cached, finish);
    // SGLang's name for the verification steps of speculative decoding.
    if let Some(o) = end.filter(|o| o.usage.spec_verify_ct > 0) {
        b["meta_info"]["spec_verify_ct"] = json!(o.usage.spec_verify_ct);
        b["meta_info"]["spec_accepted_tokens"] = json!(o.usage.spec_accepted_tokens);
    }
    b
}

/// A `/generate` body with its `meta_info`.
fn meta(
    id: &str,
    text: &str,
    ids: &[u32],
    prompt: usize,
    cached: usize,
    finish: Option<Value>,
) -> Value {
    json!({
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": id,
            "prompt_tokens": prompt,
            "completion_tokens": ids.len(),
            "cached_tokens": cached,
            "finish_reason": finish,
        },
    })
}

/// `POST /generate`.
pub async fn generate(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<GenerateRequest>,
) -> Result<Response, ApiError> {
    state.accepting()?;
    state.check_model(req.model.as_deref())?;
    let checked = refuse_unsupported(&req.rest, "", &[])
        .and_then(|()| {
            refuse_unsupported(
                &req.sampling_params.rest,
                "sampling_params.",
                SGLANG_SAMPLING,
            )
        })
        .and_then(|()| match req.top_logprobs_num {
            n if n > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
                format!("top_logprobs_num must be at most {MAX_TOP_LOGPROBS}"),
                Some("top_logprobs_num"),
            )),
            _ => Ok(()),
        });
    checked.inspect_err(|_| state.rejected())?;
    let prompt = match (req.input_ids, req.text) {
        (Some(ids), None) => ids,
        (None, Some(t)) => state.encode(t, "text").await?,
        _ => {
            state.rejected();
            return Err(ApiError::invalid(
                "give exactly one of input_ids and text",
                Some("input_ids"),
            ));
        }
    };
    let s = req.sampling_params;
    let raw = RawSampling {
        names: &SGLANG_NAMES,
        // SGLang's default when max_new_tokens is absent.
        max_tokens: Some(s.max_new_tokens.unwrap_or(128)),
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        seed: s.seed,
        n: s.n,
        stop: s.stop,
        stop_token_ids: s.stop_token_ids,
        ignore_eos: s.ignore_eos,
        logprobs: req.return_logprob.then_some(req.top_logprobs_num),
    };
    let p = prepare(&state, prompt, raw, "input_ids").inspect_err(|_| state.rejected())?;
    if p.n != 1 {
        state.rejected();
        return Err(ApiError::invalid(
            "only sampling_params.n = 1 is supported on /generate (use n on the OpenAI endpoints)",
            Some("sampling_params.n"),
        ));
    }
    let session = session_id(&headers).or(req.session_id);
    let mut pieces = start(&state, &p, session, None)?;
    let (id, prompt_len) = (p.id.to_string(), p.prompt.len());
    let wanted = req.return_logprob;
    if req.stream {
        let (mut text, mut logprobs) = (String::new(), Vec::new());
        return Ok(sse(pieces, move |piece, ids| match piece {
            Err(e) => {
                // SGLang's shape for a request the server ended: finish_reason "abort".
                let finish = json!({"type": "abort", "message": e.message});
                vec![e.body(), meta(&id, &text, ids, prompt_len, 0, Some(finish))]
            }
            Ok(Piece::Delta {
                text: t,
                logprobs: l,
                ..
            }) => {
                text.push_str(&t);
                logprobs.extend(l);
                let mut b = body(&id, &text, ids, prompt_len, 0, None);
                with_logprobs(&mut b, wanted, ids, &logprobs);
                vec![b]
            }
            Ok(Piece::Done(o)) => {
                let mut b = body(&id, &text, ids, prompt_len, 0, Some(&o));
                with_logprobs(&mut b, wanted, ids, &logprobs);
                vec![b]
            }
        }));
    }
    let mut text = String::new();
    loop {
        match pieces.next().await {
            Some(Ok(Piece::Delta { text: t, .. })) => text.push_str(&t),
            Some(Ok(Piece::Done(o))) => {
                let mut b = body(&id, &text, pieces.ids(), prompt_len, 0, Some(&o));
                with_logprobs(&mut b, wanted, pieces.ids(), pieces.logprobs());
                return Ok(Json(b).into_response());
            }
            Some(Err(e)) => return Err(e),
            None => unreachable!("pieces end with Done or an error"),
        }
    }
}
