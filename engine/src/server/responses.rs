//! OpenAI's Responses API (`POST /v1/responses`), what Codex speaks: `input` as a string
//! or items (messages, `function_call`, `function_call_output`), `instructions`, function
//! `tools`, streamed as the API's typed events or whole. Like the Messages API it is
//! translated into the chat pipeline (the model's chat format, tools, stop handling); the
//! reply becomes output items: a `message` with `output_text`, then a `function_call` per
//! call (`call_id` in the chat format's `functions.NAME:IDX` form). Responses are not
//! stored: `previous_response_id` is refused, so a client re-sends its conversation (as
//! Codex does with `store: false`).
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::call_stream::CallStream;
use super::chat_format::{ChatMessage, Content, FunctionCall, ToolCall};
use super::error::{ApiError, ApiJson};
use super::fields::{refuse_unsupported, PENALTIES};
use super::grammar::output_format;
use super::openai::{
    chat_prompt, collect, forced_pieces, forced_prefix, reasoning, reply_ends, reply_grammar,
    tool_calls,
};
use super::pieces::{Outcome, Piece, Pieces};
use super::run::{named_sse, prepare, start, RawSampling, SamplingNames};
use super::tools;
use super::{session_id, unix_time, SharedState};
use crate::scheduler::FinishReason;

const NAMES: SamplingNames = SamplingNames {
    max_tokens: "max_output_tokens",
    temperature: "temperature",
    top_p: "top_p",
    top_k: "top_k",
    min_p: "min_p",
    n: "n",
};

/// `input`: a string (one user message) or items.
#[derive(Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Item>),
}

/// A message's content: a string or parts (`input_text`, `output_text`).
#[derive(Deserialize)]
#[serde(untagged)]
enum ItemContent {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Item {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    role: Option<String>,
    content: Option<ItemContent>,
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    output: Option<Value>,
    /// A reasoning item's summary parts (`summary_text`).
    summary: Option<Vec<Part>>,
}

#[derive(Deserialize)]
pub struct ResponsesRequest {
    model: Option<String>,
    input: Input,
    instructions: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not OpenAI's; vLLM's and SGLang's filters, accepted here too.
    top_k: Option<i64>,
    min_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    /// Every other field: refused unless harmless (`store`, `parallel_tool_calls`,
    /// `metadata`, plain-text output, no reasoning).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

fn invalid(what: impl Into<String>, param: &str) -> ApiError {
    ApiError::invalid(what, Some(param))
}

fn text_of(content: Option<ItemContent>, at: &str) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(ItemContent::Text(t)) => Ok(t),
        Some(ItemContent::Parts(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                match (p.kind.as_str(), p.text) {
                    ("input_text" | "output_text" | "text", Some(t)) => out.push(t),
                    (kind, _) => {
                        return Err(invalid(
                            format!("{at}.content: {kind} parts are not supported"),
                            "input",
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
    }
}

/// The conversation as chat messages: `instructions` as the system message, then the
/// items in order (consecutive function calls join the assistant turn before them).
fn chat_messages(instructions: Option<String>, input: Input) -> Result<Vec<ChatMessage>, ApiError> {
    let message = |role: &str, text: String| ChatMessage {
        role: role.into(),
        content: Some(Content::Text(text)),
        ..Default::default()
    };
    let mut out: Vec<ChatMessage> = instructions
        .map(|i| message("system", i))
        .into_iter()
        .collect();
    let items = match input {
        Input::Text(t) => return Ok([out, vec![message("user", t)]].concat()),
        Input::Items(items) => items,
    };
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("input[{i}]");
        match item.kind.as_deref().unwrap_or("message") {
            "message" => {
                let role = match item.role.as_deref() {
                    Some("developer" | "system") => "system",
                    Some(r @ ("user" | "assistant")) => r,
                    other => {
                        return Err(invalid(
                            format!("{at}.role {other:?} is not supported"),
                            "input",
                        ))
                    }
                };
                let text = text_of(item.content, &at)?;
                match out.last_mut() {
                    // The answer after a reasoning item: the same assistant turn.
                    Some(last)
                        if role == "assistant"
                            && last.role == "assistant"
                            && last.reasoning_content.is_some()
                            && last.content == Some(Content::Text(String::new()))
                            && last.tool_calls.is_none() =>
                    {
                        last.content = Some(Content::Text(text))
                    }
                    _ => out.push(message(role, text)),
                }
            }
            "function_call" => {
                let (Some(id), Some(name)) = (item.call_id, item.name) else {
                    return Err(invalid(
                        format!("{at}: a function_call needs call_id and name"),
                        "input",
                    ));
                };
                let call = ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: item.arguments.unwrap_or_default(),
                    },
                };
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => {
                        last.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => {
                        let mut turn = message("assistant", String::new());
                        turn.tool_calls = Some(vec![call]);
                        out.push(turn);
                    }
                }
            }
            "reasoning" => {
                // Earlier reasoning: its text, or else its summary, on the assistant turn.
                let parts = match item.content {
                    Some(ItemContent::Parts(p)) if !p.is_empty() => p,
                    Some(ItemContent::Text(t)) => vec![Part {
                        kind: "reasoning_text".into(),
                        text: Some(t),
                    }],
                    _ => item.summary.unwrap_or_default(),
                };
                let text: Vec<String> = parts.into_iter().filter_map(|p| p.text).collect();
                let mut turn = message("assistant", String::new());
                turn.reasoning_content = Some(text.join("\n"));
                out.push(turn);
            }
            "function_call_output" => {
                let Some(id) = item.call_id else {
                    return Err(invalid(
                        format!("{at}: a function_call_output needs call_id"),
                        "input",
                    ));
                };
                let text = match item.output {
                    Some(Value::String(s)) => s,
                    Some(other) => other.to_string(),
                    None => String::new(),
                };
                let mut result = message("tool", text);
                result.tool_call_id = Some(id);
                out.push(result);
            }
            other => {
                return Err(invalid(
                    format!("{at}: {other} items are not supported"),
                    "input",
                ))
            }
        }
    }
    Ok(out)
}

/// Function tools in the chat endpoint's shape (`{"type": "function", "name", ...}` ->
/// `{"type": "function", "function": {"name", ...}}`); other tool types are refused.
fn chat_tools(tools: Option<Vec<Value>>) -> Result<Option<Value>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    let mut out = Vec::new();
    for (i, t) in tools.into_iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                format!("tools[{i}].type: only function tools are supported"),
                "tools",
            ));
        }
        out.push(json!({"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": t.get("parameters")}}));
    }
    Ok(Some(json!(out)))
}

/// `tool_choice` in the chat endpoint's shape: the Responses API names a function at the
/// top level (`{"type": "function", "name"}`); the strings are the same.
fn chat_tool_choice(choice: Option<Value>) -> Option<Value> {
    choice.map(
        |c| match (c.get("type").and_then(Value::as_str), c.get("name")) {
            (Some("function"), Some(name)) => {
                json!({"type": "function", "function": {"name": name}})
            }
            _ => c,
        },
    )
}

fn refuse(rest: &Map<String, Value>, thinks: bool) -> Result<(), ApiError> {
    let mut rest = rest.clone();
    for harmless in [
        "store",
        "parallel_tool_calls",
        "include",
        "prompt_cache_key",
        "truncation",
    ] {
        rest.remove(harmless);
    }
    // `text.format`: structured output, read by the handler.
    rest.remove("text");
    if let Some(reasoning) = rest.remove("reasoning") {
        // A thinking model reasons as it was trained to: `effort` is not a knob it has.
        if !reasoning.is_null() && !thinks {
            return Err(invalid(
                "reasoning is not supported by this model",
                "reasoning",
            ));
        }
    }
    if rest
        .get("previous_response_id")
        .is_some_and(|v| !v.is_null())
    {
        return Err(invalid(
            "previous_response_id: responses are not stored; send the whole conversation",
            "previous_response_id",
        ));
    }
    refuse_unsupported(&rest, "", &[PENALTIES])
}

/// `POST /v1/responses`.
pub async fn responses(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Result<Response, ApiError> {
    let refused = |e: ApiError| {
        state.rejected();
        e
    };
    state.accepting()?;
    state.check_model(req.model.as_deref()).map_err(refused)?;
    refuse(&req.rest, state.think.is_some()).map_err(refused)?;
    let declared = chat_tools(req.tools).map_err(refused)?;
    let choice = chat_tool_choice(req.tool_choice);
    let tools = tools::resolve(declared.as_ref(), choice.as_ref()).map_err(refused)?;
    let messages = chat_messages(req.instructions, req.input).map_err(refused)?;
    let prompt = chat_prompt(&state, messages, tools.as_ref(), "input")
        .await
        .map_err(refused)?;
    let (stops, end_of_text) = reply_ends(&state, tools.as_ref(), Vec::new());
    let sampling = RawSampling {
        names: &NAMES,
        max_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: None,
        n: None,
        stop: None,
        stop_token_ids: Some(stops),
        ignore_eos: None,
        logprobs: None,
    };
    let mut p = prepare(&state, prompt, sampling, "input").map_err(refused)?;
    let format = req.rest.get("text").and_then(|t| t.get("format"));
    let format = output_format(&state, format, "text.format").map_err(refused)?;
    p.grammar = reply_grammar(&state, format, tools.as_ref()).map_err(refused)?;
    let pieces = start(&state, &p, session_id(&headers), end_of_text)?;
    let pieces = forced_pieces(tools.as_ref(), pieces);
    let mut pieces = match state.think {
        Some(think) => pieces.split_reasoning(reasoning(&state, think, &p.prompt)),
        None => pieces,
    };
    let head = Head {
        id: format!("resp_{}", p.id),
        created: unix_time(),
        model: state.model_name.clone(),
    };
    if req.stream {
        return Ok(stream(state, pieces, head, tools));
    }
    let (text, outcome) = collect(&mut pieces).await?;
    let calls = tool_calls(&state, tools.as_ref(), pieces.ids());
    let mut output = Vec::new();
    if let Some(r) = pieces.reasoning().filter(|r| !r.is_empty()) {
        output.push(reasoning_item(&head.id, r));
    }
    if !text.is_empty() || calls.is_empty() {
        output.push(message_item(&head.id, &text));
    }
    output.extend(calls.iter().map(|c| call_item(&head.id, c)));
    Ok(Json(head.response(output, Some(&outcome))).into_response())
}

/// What every event of one response repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    /// The response object: in progress (no outcome yet), completed, or incomplete at the
    /// token limit.
    fn response(&self, output: Vec<Value>, outcome: Option<&Outcome>) -> Value {
        let status = match outcome.map(|o| o.reason) {
            None => "in_progress",
            Some(FinishReason::Length) => "incomplete",
            Some(_) => "completed",
        };
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "incomplete_details": incomplete,
            "error": null,
            "usage": outcome.map(|o| json!({
                "input_tokens": o.usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": o.usage.cached_tokens},
                "output_tokens": o.usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": o.reasoning_tokens},
                "total_tokens": o.usage.prompt_tokens + o.usage.completion_tokens,
            })),
        })
    }
}

fn message_item(id: &str, text: &str) -> Value {
    json!({"type": "message", "id": format!("msg_{id}"), "status": "completed",
           "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    json!({"type": "reasoning", "id": format!("rs_{id}"), "status": "completed", "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: &str, call: &ToolCall) -> Value {
    json!({"type": "function_call", "id": format!("fc_{id}_{}", call.id), "status": "completed",
           "call_id": call.id, "name": call.function.name, "arguments": call.function.arguments})
}

/// The response as the API's events: created, the message item with its text part and
/// deltas (closed when the text ends), a function-call item per call as it generates (added
/// once the call's id is complete, its arguments as deltas, [`CallStream`]), then completed
/// (or incomplete).
fn stream(state: SharedState, pieces: Pieces, head: Head, tools: Option<tools::Tools>) -> Response {
    let mut seq = 0u64;
    let (mut text, mut reasoning) = (String::new(), String::new());
    let mut started = false;
    let mut message_open = true;
    let mut calls = CallStream::new(forced_prefix(&state, tools.as_ref()));
    // The call item being streamed: its item (arguments so far) and output index.
    let mut open_call: Option<(Value, usize)> = None;
    named_sse(pieces, move |piece, ids| {
        let mut out: Vec<(&'static str, Value)> = Vec::new();
        let mut emit = |name: &'static str, mut v: Value| {
            v["type"] = json!(name);
            v["sequence_number"] = json!(seq);
            seq += 1;
            out.push((name, v));
        };
        let msg_id = format!("msg_{}", head.id);
        if !started {
            started = true;
            emit(
                "response.created",
                json!({"response": head.response(vec![], None)}),
            );
            emit(
                "response.in_progress",
                json!({"response": head.response(vec![], None)}),
            );
            let item = json!({"type": "message", "id": msg_id, "status": "in_progress",
                              "role": "assistant", "content": []});
            emit(
                "response.output_item.added",
                json!({"output_index": 0, "item": item}),
            );
            emit(
                "response.content_part.added",
                json!({"item_id": msg_id, "output_index": 0,
                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
        }
        // The message item ends where the text does: before the first call, or at the end.
        let mut close_message = |emit: &mut dyn FnMut(&'static str, Value), text: &str| {
            if std::mem::take(&mut message_open) {
                emit(
                    "response.output_text.done",
                    json!({"item_id": msg_id, "output_index": 0,
                    "content_index": 0, "text": text}),
                );
                emit(
                    "response.content_part.done",
                    json!({"item_id": msg_id, "output_index": 0,
                    "content_index": 0, "part": {"type": "output_text", "text": text, "annotations": []}}),
                );
                emit(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": message_item(&head.id, text)}),
                );
            }
        };
        let close_call = |emit: &mut dyn FnMut(&'static str, Value),
                          call: Option<(Value, usize)>| {
            if let Some((mut item, index)) = call {
                item["status"] = json!("completed");
                emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": item["id"], "output_index": index,
                    "arguments": item["arguments"]}),
                );
                emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
        };
        match piece {
            Err(e) => emit(
                "error",
                json!({"code": "engine_error",
                "message": e.body()["error"]["message"], "param": null}),
            ),
            Ok(Piece::Delta {
                text: t,
                reasoning: r,
                ids: new,
                ..
            }) => {
                reasoning.push_str(&r);
                if !t.is_empty() {
                    text.push_str(&t);
                    emit(
                        "response.output_text.delta",
                        json!({"item_id": msg_id, "output_index": 0,
                        "content_index": 0, "delta": t}),
                    );
                }
                let (Some(fmt), Some(tools)) = (state.chat.as_ref(), tools.as_ref()) else {
                    return out;
                };
                for entry in calls.push(fmt, &state.codec, tools, &new) {
                    let index = entry["index"].as_u64().unwrap_or(0) as usize + 1;
                    let function = &entry["function"];
                    if entry.get("id").is_some() {
                        close_message(&mut emit, &text);
                        close_call(&mut emit, open_call.take());
                        let call_id = entry["id"].as_str().unwrap_or_default();
                        let item = json!({"type": "function_call",
                            "id": format!("fc_{}_{call_id}", head.id), "status": "in_progress",
                            "call_id": call_id, "name": function["name"], "arguments": ""});
                        emit(
                            "response.output_item.added",
                            json!({"output_index": index, "item": item}),
                        );
                        open_call = Some((item, index));
                    } else if let Some((item, _)) = open_call.as_mut() {
                        let more = function["arguments"].as_str().unwrap_or_default();
                        let so_far = item["arguments"].as_str().unwrap_or_default().to_string();
                        item["arguments"] = json!(so_far + more);
                        emit(
                            "response.function_call_arguments.delta",
                            json!({"item_id": item["id"], "output_index": index, "delta": more}),
                        );
                    }
                }
            }
            Ok(Piece::Done(o)) => {
                close_message(&mut emit, &text);
                close_call(&mut emit, open_call.take());
                let mut output = vec![message_item(&head.id, &text)];
                output.extend(
                    (tool_calls(&state, tools.as_ref(), ids).iter())
                        .map(|c| call_item(&head.id, c)),
                );
                // A thinking model's reasoning, kept out of the text, as an item of its own
                // after the others (its text is whole only now).
                if !reasoning.is_empty() {
                    let item = reasoning_item(&head.id, &reasoning);
                    let index = output.len();
                    emit(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    );
                    emit(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    );
                    output.push(item);
                }
                let done = match o.reason {
                    FinishReason::Length => "response.incomplete",
                    _ => "response.completed",
                };
                emit(done, json!({"response": head.response(output, Some(&o))}));
            }
        }
        out
    })
}
