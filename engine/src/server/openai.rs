//! OpenAI's `POST /v1/completions` and `POST /v1/chat/completions`, streaming (SSE) or not,
//! with `usage.prompt_tokens_details.cached_tokens` and, on request (`return_token_ids`),
//! the prompt's and the completion's token ids (vLLM's field names).
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::call_stream::CallStream;
use super::chat_format::KimiFormat;
use super::chat_format::{ChatMessage, ToolCall};
use super::chat_template::ChatTemplate;
use super::choices::{collect_all, start_choices, Total};
use super::error::{ApiError, ApiJson};
use super::fields::{refuse_unsupported, OPENAI};
use super::grammar::{output_format, Grammar};
use super::logprobs::{chat_logprobs, completion_logprobs};
use super::pieces::{Outcome, Piece, Pieces};
use super::reasoning::{Reasoning, ThinkTokens};
use super::run::{prepare, sse_choices, RawSampling, Stop, MAX_TOP_LOGPROBS, OPENAI_NAMES};
use super::tools::{self, Tools};
use super::{session_id, unix_time, AppState, SharedState};
use crate::scheduler::FinishReason;

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields both endpoints share.
#[derive(Deserialize, Default)]
pub struct Common {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    n: Option<i64>,
    stop: Option<Stop>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    return_token_ids: bool,
    /// Chat's `true`, or the completions API's count of alternatives.
    logprobs: Option<Value>,
    /// Chat's count of alternatives.
    top_logprobs: Option<i64>,
    /// Structured output: `{"type": "json_object"}` or `{"type": "json_schema", ...}`.
    response_format: Option<Value>,
    /// Every other field: refused unless harmless (see `fields`).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

impl Common {
    fn sampling(&self) -> RawSampling {
        RawSampling {
            names: &OPENAI_NAMES,
            max_tokens: self.max_completion_tokens.or(self.max_tokens),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            n: self.n,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs_wanted(),
        }
    }

    /// How many alternatives each token's log-probabilities list, if they are wanted
    /// (after [`Self::check`]).
    fn logprobs_wanted(&self) -> Option<usize> {
        match &self.logprobs {
            Some(Value::Bool(true)) => Some(self.top_logprobs.unwrap_or(0) as usize),
            Some(Value::Number(n)) => n.as_u64().map(|n| n as usize),
            _ => None,
        }
    }

    /// Refuses what the server does not do rather than ignoring it silently; 503 while
    /// the server drains.
    fn check(&self, state: &AppState) -> Result<(), ApiError> {
        state.accepting()?;
        state.check_model(self.model.as_deref())?;
        refuse_unsupported(&self.rest, "", OPENAI).inspect_err(|_| state.rejected())?;
        let in_range = |n: i64| (0..=MAX_TOP_LOGPROBS as i64).contains(&n);
        let refuse = |what: String, field| {
            state.rejected();
            Err(ApiError::invalid(what, Some(field)))
        };
        match (&self.logprobs, self.top_logprobs) {
            (None | Some(Value::Null) | Some(Value::Bool(false)), None | Some(0)) => Ok(()),
            (None | Some(Value::Null) | Some(Value::Bool(false)), Some(_)) => {
                refuse("top_logprobs needs logprobs: true".into(), "top_logprobs")
            }
            (Some(Value::Bool(true)), top) if top.is_none_or(in_range) => Ok(()),
            (Some(Value::Bool(true)), _) => refuse(
                format!("top_logprobs must be in 0..={MAX_TOP_LOGPROBS}"),
                "top_logprobs",
            ),
            (Some(Value::Number(n)), None) if n.as_i64().is_some_and(in_range) => Ok(()),
            _ => refuse(
                format!("logprobs must be a boolean, or a count in 0..={MAX_TOP_LOGPROBS}"),
                "logprobs",
            ),
        }
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    prompt: Prompt,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
pub struct ChatRequest {
    messages: Vec<ChatMessage>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// SGLang's switch: `false` keeps a thinking model's reasoning in `content`.
    #[serde(default = "yes")]
    separate_reasoning: bool,
    #[serde(flatten)]
    common: Common,
}

pub(super) fn usage_json(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.usage.prompt_tokens,
        "completion_tokens": o.usage.completion_tokens,
        "total_tokens": o.usage.prompt_tokens + o.usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
    })
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let c = &req.common;
    c.check(&state)?;
    let prompt = match req.prompt {
        Prompt::Text(t) => state.encode(t, "prompt").await?,
        Prompt::Ids(ids) => ids,
        Prompt::Texts(mut v) if v.len() == 1 => state.encode(v.remove(0), "prompt").await?,
        Prompt::IdLists(v) if v.len() == 1 => v.into_iter().next().expect("one"),
        _ => {
            return Err(ApiError::invalid(
                "exactly one prompt is supported",
                Some("prompt"),
            ))
        }
    };
    let mut p =
        prepare(&state, prompt, c.sampling(), "prompt").inspect_err(|_| state.rejected())?;
    p.grammar = output_format(&state, c.response_format.as_ref(), "response_format")
        .inspect_err(|_| state.rejected())?;
    let prompt_ids = p.prompt.clone();
    let mut choices = start_choices(&state, &p, session_id(&headers), None)?;
    let (id, created, model) = (
        format!("cmpl-{}", p.id),
        unix_time(),
        state.model_name.clone(),
    );
    let ids_wanted = c.return_token_ids;
    let logprobs_wanted = c.logprobs_wanted().is_some();
    if c.stream {
        let include_usage = c.include_usage();
        let n = choices.len();
        let (mut first, mut offsets) = (vec![true; n], vec![0; n]);
        let (st, mut total) = (state.clone(), Total::new(n));
        return Ok(sse_choices(choices, move |i, piece, _| {
            let chunk = |choice: Value| {
                json!({"id": id, "object": "text_completion", "created": created,
                       "model": model, "choices": [choice]})
            };
            match piece {
                Err(e) => vec![
                    e.body(),
                    chunk(json!({"index": i, "text": "", "finish_reason": ABORT})),
                ],
                Ok(Piece::Delta {
                    text,
                    ids,
                    logprobs,
                    ..
                }) => {
                    let mut choice = json!({"index": i, "text": text, "finish_reason": null});
                    if logprobs_wanted {
                        choice["logprobs"] = completion_logprobs(&st, &ids, &logprobs, offsets[i]);
                        offsets[i] += text.len();
                    }
                    if ids_wanted {
                        choice["token_ids"] = json!(ids);
                        if std::mem::take(&mut first[i]) {
                            choice["prompt_token_ids"] = json!(prompt_ids);
                        }
                    }
                    vec![chunk(choice)]
                }
                Ok(Piece::Done(o)) => {
                    let choice =
                        json!({"index": i, "text": "", "finish_reason": o.reason.as_str()});
                    let mut out = vec![chunk(choice)];
                    if let Some(usage) = total.add(&o).filter(|_| include_usage) {
                        out.push(
                            json!({"id": id, "object": "text_completion", "created": created,
                            "model": model, "choices": [], "usage": usage}),
                        );
                    }
                    out
                }
            }
        }));
    }
    let mut total = Total::new(choices.len());
    let mut bodies = Vec::new();
    let ended = collect_all(&mut choices).await?;
    for (i, (pieces, (text, outcome))) in choices.iter().zip(ended).enumerate() {
        let mut choice = json!({"index": i, "text": text, "finish_reason": outcome.reason.as_str(),
                                "logprobs": null});
        if logprobs_wanted {
            choice["logprobs"] = completion_logprobs(&state, pieces.ids(), pieces.logprobs(), 0);
        }
        if ids_wanted {
            choice["token_ids"] = json!(pieces.ids());
            choice["prompt_token_ids"] = json!(prompt_ids);
        }
        total.add(&outcome);
        bodies.push(choice);
    }
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": bodies, "usage": total.usage(),
    }))
    .into_response())
}

/// Runs a generation to its end: the text and how it ended.
pub(super) async fn collect(pieces: &mut Pieces) -> Result<(String, Outcome), ApiError> {
    let mut text = String::new();
    loop {
        match pieces.next().await {
            Some(Ok(Piece::Delta { text: t, .. })) => text.push_str(&t),
            Some(Ok(Piece::Done(o))) => return Ok((text, o)),
            Some(Err(e)) => return Err(e),
            None => unreachable!("pieces end with Done or an error"),
        }
    }
}

/// The finish reason of a stream the server ended early (an error event precedes it):
/// vLLM's name for it.
const ABORT: &str = "abort";

/// `POST /v1/chat/completions`.
pub async fn chat(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let c = &req.common;
    c.check(&state)?;
    let refused = |e: ApiError| {
        state.rejected();
        e
    };
    if req.messages.is_empty() {
        return Err(refused(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        )));
    }
    let tools = tools::resolve(req.tools.as_ref(), req.tool_choice.as_ref()).map_err(refused)?;
    let prompt = chat_prompt(&state, req.messages, tools.as_ref(), "messages")
        .await
        .map_err(refused)?;
    let mut sampling = c.sampling();
    let stops = sampling.stop_token_ids.take().unwrap_or_default();
    let (stops, end_of_text) = reply_ends(&state, tools.as_ref(), stops);
    sampling.stop_token_ids = Some(stops);
    let mut p = prepare(&state, prompt, sampling, "messages").map_err(refused)?;
    let format = output_format(&state, c.response_format.as_ref(), "response_format");
    p.grammar = reply_grammar(&state, format.map_err(refused)?, tools.as_ref()).map_err(refused)?;
    let choices = start_choices(&state, &p, session_id(&headers), end_of_text)?
        .into_iter()
        .map(|pieces| forced_pieces(tools.as_ref(), pieces))
        .map(
            |pieces| match state.think.filter(|_| req.separate_reasoning) {
                Some(think) => pieces.split_reasoning(reasoning(&state, think, &p.prompt)),
                None => pieces,
            },
        )
        .collect();
    let reply = Reply {
        id: format!("chatcmpl-{}", p.id),
        created: unix_time(),
        model: state.model_name.clone(),
        prompt_ids: p.prompt,
        ids_wanted: c.return_token_ids,
        logprobs_wanted: c.logprobs_wanted().is_some(),
        include_usage: c.include_usage(),
        tools,
    };
    if c.stream {
        return Ok(chat_stream(state, choices, reply));
    }
    chat_whole(&state, choices, reply).await
}

/// What every chunk or body of one chat reply repeats.
struct Reply {
    id: String,
    created: u64,
    model: String,
    prompt_ids: Vec<u32>,
    ids_wanted: bool,
    logprobs_wanted: bool,
    include_usage: bool,
    /// The tools offered; `None`: no tool calls are parsed.
    tools: Option<Tools>,
}

impl Reply {
    /// A chunk of choice `i`.
    fn chunk(&self, i: usize, delta: Value, finish: Option<&str>) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": self.model, "choices": [{"index": i, "delta": delta,
               "finish_reason": finish}]})
    }
}

/// The chat reply as SSE chunks, each choice's as its pieces arrive: content deltas (none
/// once a tool-call section starts), tool calls as they generate ([`CallStream`]: a call's
/// header once its id is complete, then its arguments), the finish reason; and, if asked,
/// the usage once every choice has ended.
fn chat_stream(state: SharedState, choices: Vec<Pieces>, reply: Reply) -> Response {
    let mut first = vec![true; choices.len()];
    let prefix = forced_prefix(&state, reply.tools.as_ref());
    let mut calls: Vec<CallStream> = (choices.iter())
        .map(|_| CallStream::new(prefix.clone()))
        .collect();
    let mut total = Total::new(choices.len());
    sse_choices(choices, move |i, piece, _| {
        let mut out = Vec::new();
        if std::mem::take(&mut first[i]) {
            let mut delta = json!({"role": "assistant", "content": ""});
            if reply.ids_wanted {
                delta["prompt_token_ids"] = json!(reply.prompt_ids);
            }
            out.push(reply.chunk(i, delta, None));
        }
        match piece {
            Err(e) => {
                out.push(e.body());
                out.push(reply.chunk(i, json!({}), Some(ABORT)));
            }
            Ok(Piece::Delta {
                text,
                reasoning,
                ids,
                logprobs,
            }) => {
                let mut delta = match (text.is_empty(), reasoning.is_empty()) {
                    (true, false) => json!({"reasoning_content": reasoning}),
                    (_, true) => json!({"content": text}),
                    (false, false) => json!({"content": text, "reasoning_content": reasoning}),
                };
                if reply.ids_wanted {
                    delta["token_ids"] = json!(ids);
                }
                let mut chunk = reply.chunk(i, delta, None);
                if reply.logprobs_wanted {
                    chunk["choices"][0]["logprobs"] = chat_logprobs(&state, &ids, &logprobs);
                }
                out.push(chunk);
                if let (Some(fmt), Some(tools)) = (state.chat.as_ref(), reply.tools.as_ref()) {
                    let entries = calls[i].push(fmt, &state.codec, tools, &ids);
                    if !entries.is_empty() {
                        out.push(reply.chunk(i, json!({"tool_calls": entries}), None));
                    }
                }
            }
            Ok(Piece::Done(o)) => {
                let finish = if calls[i].streamed == 0 || o.reason == FinishReason::Length {
                    o.reason.as_str()
                } else {
                    "tool_calls"
                };
                out.push(reply.chunk(i, json!({}), Some(finish)));
                if let Some(usage) = total.add(&o).filter(|_| reply.include_usage) {
                    out.push(json!({"id": reply.id, "object": "chat.completion.chunk",
                        "created": reply.created, "model": reply.model, "choices": [],
                        "usage": usage}));
                }
            }
        }
        out
    })
}

/// The chat reply as one body, once every choice's generation ends.
async fn chat_whole(
    state: &AppState,
    mut choices: Vec<Pieces>,
    reply: Reply,
) -> Result<Response, ApiError> {
    let ended = collect_all(&mut choices).await?;
    let mut total = Total::new(choices.len());
    let mut bodies = Vec::new();
    for (i, (pieces, (text, outcome))) in choices.iter().zip(ended).enumerate() {
        let calls = tool_calls(state, reply.tools.as_ref(), pieces.ids());
        let mut message = json!({"role": "assistant", "content": text});
        if let Some(reasoning) = pieces.reasoning() {
            message["reasoning_content"] = json!(reasoning);
        }
        let finish = if calls.is_empty() || outcome.reason == FinishReason::Length {
            outcome.reason.as_str()
        } else {
            message["tool_calls"] = json!(calls);
            "tool_calls"
        };
        let mut choice = json!({"index": i, "message": message, "finish_reason": finish,
                                "logprobs": null});
        if reply.logprobs_wanted {
            choice["logprobs"] = chat_logprobs(state, pieces.ids(), pieces.logprobs());
        }
        if reply.ids_wanted {
            choice["token_ids"] = json!(pieces.ids());
        }
        total.add(&outcome);
        bodies.push(choice);
    }
    let mut body = json!({
        "id": reply.id, "object": "chat.completion", "created": reply.created,
        "model": reply.model, "choices": bodies, "usage": total.usage(),
    });
    if reply.ids_wanted {
        body["prompt_token_ids"] = json!(reply.prompt_ids);
    }
    Ok(Json(body).into_response())
}

/// The prompt of a conversation: `messages` and the tools on offer rendered in the model's
/// chat format, on the tokenizing pool; `field` names the messages in errors.
pub(super) async fn chat_prompt(
    state: &SharedState,
    messages: Vec<ChatMessage>,
    tools: Option<&Tools>,
    field: &'static str,
) -> Result<Vec<u32>, ApiError> {
    if state.template.is_none() {
        return Err(ApiError::invalid(
            "this model has no chat template (tokenizer_config.json's chat_template)",
            Some(field),
        ));
    }
    if tools.is_some() && state.chat.is_none() {
        return Err(ApiError::invalid(
            "tool calls are read in Kimi's format, and this model's tokenizer lacks its tokens",
            Some("tools"),
        ));
    }
    let bytes: usize = messages.iter().map(ChatMessage::text_bytes).sum();
    let (st, declared) = (state.clone(), tools.map(|t| t.declared.clone()));
    let forced = forced_prefix(state, tools);
    state
        .tokenize(bytes, field, move || {
            let template = st.template.as_ref().expect("checked above");
            let mut ids = template
                .prompt(&st.codec, &messages, declared.as_ref())
                .map_err(|m| ApiError::invalid(m, Some(field)))?;
            ids.extend(forced);
            Ok(ids)
        })
        .await
}

/// The split of a thinking model's reply to `prompt` into reasoning and answer; a
/// tool-call section ends the reasoning too.
pub(super) fn reasoning(state: &AppState, think: ThinkTokens, prompt: &[u32]) -> Reasoning {
    let section = state.chat.as_ref().map(KimiFormat::section_begin);
    Reasoning::new(state.codec.clone(), think, section, prompt)
}

fn yes() -> bool {
    true
}

/// What a chat reply must match: its output format's grammar, or else, when it is forced
/// into a tool call, that call's ([`super::grammar::Grammars::forced_calls`]: declared tools, arguments
/// that match their schemas). The two cannot combine.
pub(super) fn reply_grammar(
    state: &AppState,
    format: Option<Grammar>,
    tools: Option<&Tools>,
) -> Result<Option<Grammar>, ApiError> {
    let forced = tools.filter(|t| t.forced.is_some());
    let call = match (state.chat.as_ref(), state.grammars.as_ref(), forced) {
        (Some(fmt), Some(grammars), Some(tools)) => {
            let why = |e| format!("the tools' parameters cannot be followed: {e}");
            let g = grammars.forced_calls(fmt, tools);
            Some(g.map_err(|e| ApiError::invalid(why(e), Some("tools")))?)
        }
        _ => None,
    };
    match (format, call) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "an output format cannot shape a reply forced into a tool call",
            Some("tool_choice"),
        )),
        (format, call) => Ok(format.or(call)),
    }
}

/// The ids a reply forced to call a tool starts from (after the prompt; none otherwise).
pub(super) fn forced_prefix(state: &AppState, tools: Option<&Tools>) -> Vec<u32> {
    match (state.chat.as_ref(), tools.and_then(|t| t.forced.as_ref())) {
        (Some(fmt), Some(forced)) => fmt.forced_prefix(&state.codec, forced),
        _ => Vec::new(),
    }
}

/// `pieces` of a reply forced to call a tool carry no text (it starts inside the call).
pub(super) fn forced_pieces(tools: Option<&Tools>, mut pieces: Pieces) -> Pieces {
    if tools.is_some_and(|t| t.forced.is_some()) {
        pieces.close_text();
    }
    pieces
}

/// Where a chat reply ends: `stops` plus its turn's end (Kimi's `<|im_end|>`, the
/// template's `eos_token`, and whatever the model's config lists as end-of-sequence) and,
/// without tools on offer, a tool-call section's start (its marker is not text); and the id
/// after which there is no more text (with tools: that section's start).
pub(super) fn reply_ends(
    state: &AppState,
    tools: Option<&Tools>,
    mut stops: Vec<u32>,
) -> (Vec<u32>, Option<u32>) {
    stops.extend(state.template.as_ref().and_then(ChatTemplate::eos_id));
    let Some(format) = state.chat.as_ref() else {
        return (stops, None);
    };
    stops.push(format.turn_end());
    if tools.is_none() {
        stops.push(format.section_begin());
    }
    (stops, tools.map(|_| format.section_begin()))
}

/// The calls of offered tools in a reply's ids (none when no tools were offered).
pub(super) fn tool_calls(state: &AppState, tools: Option<&Tools>, ids: &[u32]) -> Vec<ToolCall> {
    let (Some(fmt), Some(tools)) = (state.chat.as_ref(), tools) else {
        return Vec::new();
    };
    let ids: Vec<u32> = forced_prefix(state, Some(tools))
        .into_iter()
        .chain(ids.iter().copied())
        .collect();
    match fmt.section_start(&ids) {
        Some(at) => tools.accept(fmt.parse_calls(&state.codec, &ids[at..])),
        None => Vec::new(),
    }
}
