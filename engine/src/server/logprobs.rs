//! Log-probabilities as the APIs return them: OpenAI chat's `logprobs.content` entries,
//! the completions API's parallel lists, SGLang's `[logprob, id, text]` triples.
use serde_json::{json, Value};

use super::AppState;
use crate::scheduler::TokenLogprobs;

/// A token as log-probability objects show it: its text, log-probability and bytes.
fn token_json(state: &AppState, id: u32, logprob: f32) -> Value {
    let text = state.codec.decode_with_special(&[id]).unwrap_or_default();
    json!({"token": text, "logprob": logprob, "bytes": state.codec.token_bytes(id)})
}

/// Chat's `logprobs` of `ids`: an entry a token, with its alternatives.
pub(super) fn chat_logprobs(state: &AppState, ids: &[u32], logprobs: &[TokenLogprobs]) -> Value {
    let content: Vec<Value> = (ids.iter().zip(logprobs))
        .map(|(&id, l)| {
            let mut entry = token_json(state, id, l.logprob);
            entry["top_logprobs"] = (l.top.iter())
                .map(|&(t, lp)| token_json(state, t, lp))
                .collect();
            entry
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The completions API's `logprobs` of `ids`, whose text starts `offset` bytes into the
/// completion.
pub(super) fn completion_logprobs(
    state: &AppState,
    ids: &[u32],
    logprobs: &[TokenLogprobs],
    mut offset: usize,
) -> Value {
    let text = |id| state.codec.decode_with_special(&[id]).unwrap_or_default();
    let (mut tokens, mut offsets) = (Vec::new(), Vec::new());
    for &id in ids {
        let t = text(id);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
    }
    let top: Vec<Value> = (logprobs.iter())
        .map(|l| {
            let alternatives: serde_json::Map<String, Value> =
                l.top.iter().map(|&(t, lp)| (text(t), json!(lp))).collect();
            Value::Object(alternatives)
        })
        .collect();
    json!({"tokens": tokens, "token_logprobs": logprobs.iter().map(|l| l.logprob).collect::<Vec<_>>(),
           "top_logprobs": top, "text_offset": offsets})
}

/// SGLang's log-probability fields in `b`'s `meta_info` (`[logprob, id, text]` triples,
/// text not asked for), when `wanted`.
pub(super) fn with_logprobs(b: &mut Value, wanted: bool, ids: &[u32], logprobs: &[TokenLogprobs]) {
    if !wanted {
        return;
    }
    let triple = |lp: f32, id: u32| json!([lp, id, null]);
    let (tokens, top): (Vec<Value>, Vec<Value>) = (ids.iter().zip(logprobs))
        .map(|(&id, l)| {
            let top: Vec<Value> = l.top.iter().map(|&(t, lp)| triple(lp, t)).collect();
            (triple(l.logprob, id), json!(top))
        })
        .unzip();
    b["meta_info"]["output_token_logprobs"] = json!(tokens);
    b["meta_info"]["output_top_logprobs"] = json!(top);
}
