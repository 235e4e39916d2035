//! Anthropic's Messages API, what Claude Code speaks: `POST /v1/messages` (text and tool
//! use, streamed as Anthropic's events or whole) and `POST /v1/messages/count_tokens`.
//! A request is translated into the chat pipeline the OpenAI endpoint runs (the model's
//! chat format, tool declarations and `tool_choice`, stop handling), and the reply back
//! into content blocks (`text`, then `tool_use`), a `stop_reason` and a usage whose
//! `cache_read_input_tokens` are the prompt tokens the prefix cache served. Tool-use ids
//! are the chat format's (`functions.NAME:IDX`); a `tool_result` names one and goes back
//! to the model under it. Errors keep the server's error body (`error.message` is where
//! Anthropic's clients read it).
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
use super::openai::{
    chat_prompt, collect, forced_pieces, forced_prefix, reasoning, reply_ends, reply_grammar,
    tool_calls,
};
use super::pieces::{Outcome, Piece, Pieces};
use super::run::{named_sse, prepare, start, RawSampling, SamplingNames, Stop};
use super::tools::{self, Tools};
use super::{session_id, SharedState};
use crate::scheduler::FinishReason;

/// The Messages API's names for the sampling fields.
const NAMES: SamplingNames = SamplingNames {
    max_tokens: "max_tokens",
    temperature: "temperature",
    top_p: "top_p",
    top_k: "top_k",
    min_p: "min_p",
    n: "n",
};

/// `system`: a string or text blocks.
#[derive(Deserialize)]
#[serde(untagged)]
enum System {
    Text(String),
    Blocks(Vec<TextBlock>),
}

#[derive(Deserialize)]
struct TextBlock {
    text: String,
}

/// A message's content: a string or blocks.
#[derive(Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Blocks(Vec<Block>),
}

/// The content blocks a conversation carries (fields such as `cache_control` are ignored:
/// prefix caching is automatic).
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<System>,
    },
    /// A thinking model's earlier reasoning, sent back (its signature is not checked).
    Thinking {
        thinking: String,
    },
    /// Reasoning a server hid: nothing kiln can render.
    RedactedThinking {},
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: MessageContent,
}

#[derive(Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Value,
}

#[derive(Deserialize)]
pub struct MessagesRequest {
    model: Option<String>,
    max_tokens: Option<i64>,
    messages: Vec<Message>,
    system: Option<System>,
    tools: Option<Vec<Tool>>,
    tool_choice: Option<Value>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    /// Not Anthropic's; vLLM's and SGLang's filter, accepted here too.
    min_p: Option<f32>,
    stop_sequences: Option<Vec<String>>,
    /// Every other field: refused unless harmless (`metadata`, thinking disabled, a
    /// penalty or filter left off).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

impl System {
    fn text(self) -> String {
        match self {
            System::Text(t) => t,
            System::Blocks(b) => b.into_iter().map(|b| b.text).collect::<Vec<_>>().join("\n"),
        }
    }
}

/// The conversation as chat messages: `system` first; a user turn's tool results as tool
/// messages (in order) before its text; an assistant turn's text and tool calls as one.
fn chat_messages(
    system: Option<System>,
    messages: Vec<Message>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let message = |role: &str, text: String| ChatMessage {
        role: role.into(),
        content: Some(Content::Text(text)),
        ..Default::default()
    };
    let mut out: Vec<ChatMessage> = system
        .map(|s| message("system", s.text()))
        .into_iter()
        .collect();
    for (i, m) in messages.into_iter().enumerate() {
        let blocks = match m.content {
            MessageContent::Text(t) => vec![Block::Text { text: t }],
            MessageContent::Blocks(b) => b,
        };
        let (mut text, mut calls, mut reasoning) = (Vec::new(), Vec::new(), Vec::new());
        for block in blocks {
            match (m.role.as_str(), block) {
                (_, Block::Text { text: t }) => text.push(t),
                ("assistant", Block::Thinking { thinking }) => reasoning.push(thinking),
                ("assistant", Block::RedactedThinking {}) => {}
                ("assistant", Block::ToolUse { id, name, input }) => calls.push(ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: input.to_string(),
                    },
                }),
                (
                    "user",
                    Block::ToolResult {
                        tool_use_id,
                        content,
                    },
                ) => {
                    let mut result = message("tool", content.map_or(String::new(), System::text));
                    result.tool_call_id = Some(tool_use_id);
                    out.push(result);
                }
                (role, _) => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}]: a {role} message cannot carry this block"),
                        Some("messages"),
                    ))
                }
            }
        }
        match m.role.as_str() {
            "user" if text.is_empty() => {}
            "user" | "assistant" => {
                let mut turn = message(&m.role, text.join("\n"));
                turn.tool_calls = (!calls.is_empty()).then_some(calls);
                turn.reasoning_content = (!reasoning.is_empty()).then(|| reasoning.join("\n"));
                out.push(turn);
            }
            other => {
                return Err(ApiError::invalid(
                    format!("messages[{i}].role must be user or assistant, got {other:?}"),
                    Some("messages"),
                ))
            }
        }
    }
    Ok(out)
}

/// `tools` and `tool_choice` in OpenAI's shapes, resolved as the chat endpoint does.
fn resolve_tools(
    tools: Option<Vec<Tool>>,
    choice: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let declared = tools.map(|list| {
        json!(list
            .into_iter()
            .map(|t| json!({"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}))
            .collect::<Vec<_>>())
    });
    let choice = match choice {
        None | Some(Value::Null) => None,
        Some(c) => Some(match c.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": c.get("name")}}),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice.type must be auto, any, tool or none",
                    Some("tool_choice"),
                ))
            }
        }),
    };
    tools::resolve(declared.as_ref(), choice.as_ref())
}

/// Refuses fields the server cannot honour (extended thinking of a model that does not
/// think, penalties or filters other than off); whether thinking blocks are wanted.
fn refuse(rest: &Map<String, Value>, thinks: bool) -> Result<bool, ApiError> {
    let mut rest = rest.clone();
    let thinking = rest.remove("thinking").filter(|t| !t.is_null());
    let wanted =
        thinking.is_some_and(|t| t.get("type").and_then(Value::as_str) != Some("disabled"));
    if wanted && !thinks {
        return Err(ApiError::invalid(
            "extended thinking is not supported by this model",
            Some("thinking"),
        ));
    }
    refuse_unsupported(&rest, "", &[PENALTIES])?;
    Ok(wanted)
}

/// The prompt of a request: its conversation in the model's chat format (and the tools on
/// offer), after every check a generation makes; and whether it wants thinking blocks.
async fn prompt(
    state: &SharedState,
    req: &mut MessagesRequest,
) -> Result<(Vec<u32>, Option<Tools>, bool), ApiError> {
    state.accepting()?;
    state.check_model(req.model.as_deref())?;
    let thinking = refuse(&req.rest, state.think.is_some())?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let tools = resolve_tools(req.tools.take(), req.tool_choice.as_ref())?;
    let messages = chat_messages(req.system.take(), std::mem::take(&mut req.messages))?;
    let ids = chat_prompt(state, messages, tools.as_ref(), "messages").await?;
    Ok((ids, tools, thinking))
}

/// `POST /v1/messages/count_tokens`: the prompt's length, as `/v1/messages` would run it.
pub async fn count_tokens(
    State(state): State<SharedState>,
    ApiJson(mut req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let (ids, _, _) = prompt(&state, &mut req)
        .await
        .inspect_err(|_| state.rejected())?;
    Ok(Json(json!({"input_tokens": ids.len()})).into_response())
}

/// `POST /v1/messages`.
pub async fn messages(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(mut req): ApiJson<MessagesRequest>,
) -> Result<Response, ApiError> {
    let refused = |e: ApiError| {
        state.rejected();
        e
    };
    let Some(max_tokens) = req.max_tokens else {
        return Err(refused(ApiError::invalid(
            "max_tokens is required",
            Some("max_tokens"),
        )));
    };
    let (ids, tools, thinking) = prompt(&state, &mut req).await.map_err(refused)?;
    let (stops, end_of_text) = reply_ends(&state, tools.as_ref(), Vec::new());
    let sampling = RawSampling {
        names: &NAMES,
        max_tokens: Some(max_tokens),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        seed: None,
        n: None,
        stop: req.stop_sequences.take().map(Stop::Many),
        stop_token_ids: Some(stops),
        ignore_eos: None,
        logprobs: None,
    };
    let mut p = prepare(&state, ids, sampling, "messages").map_err(refused)?;
    p.grammar = reply_grammar(&state, None, tools.as_ref()).map_err(refused)?;
    let pieces = start(&state, &p, session_id(&headers), end_of_text)?;
    let pieces = forced_pieces(tools.as_ref(), pieces);
    // A thinking model's reasoning never reaches the text: it is a thinking block when
    // the request enabled thinking, and left out otherwise.
    let mut pieces = match state.think {
        Some(think) => pieces.split_reasoning(reasoning(&state, think, &p.prompt)),
        None => pieces,
    };
    let reply = Reply {
        id: format!("msg_{}", p.id),
        model: state.model_name.clone(),
        prompt_tokens: p.prompt.len(),
        tools,
        thinking,
    };
    if req.stream {
        return Ok(stream(state, pieces, reply));
    }
    let (text, outcome) = collect(&mut pieces).await?;
    let calls = tool_calls(&state, reply.tools.as_ref(), pieces.ids());
    let mut content = Vec::new();
    if let Some(thinking) = pieces.reasoning().filter(|_| reply.thinking) {
        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    if !text.is_empty() || calls.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(calls.iter().map(tool_use));
    let (reason, sequence) = stop_reason(&outcome, &calls);
    Ok(Json(json!({
        "id": reply.id, "type": "message", "role": "assistant", "model": reply.model,
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(&outcome),
    }))
    .into_response())
}

/// What every event of one reply repeats.
struct Reply {
    id: String,
    model: String,
    prompt_tokens: usize,
    tools: Option<Tools>,
    /// Whether the reasoning goes out as a thinking block.
    thinking: bool,
}

/// A tool call as a `tool_use` block (its arguments as JSON; text that is not JSON stays a
/// string).
fn tool_use(call: &ToolCall) -> Value {
    let input = serde_json::from_str::<Value>(&call.function.arguments)
        .unwrap_or_else(|_| Value::String(call.function.arguments.clone()));
    json!({"type": "tool_use", "id": call.id, "name": call.function.name, "input": input})
}

/// Anthropic's `stop_reason` and `stop_sequence` for how a generation ended.
fn stop_reason(o: &Outcome, calls: &[ToolCall]) -> (&'static str, Value) {
    match (o.reason, o.stop_string.as_deref()) {
        (FinishReason::Length, _) => ("max_tokens", Value::Null),
        (_, _) if !calls.is_empty() => ("tool_use", Value::Null),
        (_, Some(s)) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

/// Usage: input tokens the cache did not serve, those it did, and output tokens.
fn usage(o: &Outcome) -> Value {
    json!({
        "input_tokens": o.usage.prompt_tokens - o.usage.cached_tokens,
        "cache_read_input_tokens": o.usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": o.usage.completion_tokens,
    })
}

/// The reply as Anthropic's events: `message_start`; with thinking enabled a thinking
/// block (`thinking_delta`s) until the reasoning ends; a text block's start, deltas and
/// stop; then a `tool_use` block per call as it generates (its start once the call's id is
/// complete, its input as `input_json_delta` fragments, [`CallStream`]); `message_delta`
/// with the stop reason and usage, `message_stop`. Blocks are numbered as they start.
fn stream(state: SharedState, pieces: Pieces, reply: Reply) -> Response {
    let mut started = false;
    let mut calls = CallStream::new(forced_prefix(&state, reply.tools.as_ref()));
    // The content block open now, the text block's index once it started, blocks started,
    // and each call's block.
    let (mut open, mut text_block, mut blocks) = (None, None, 0);
    let mut call_blocks: Vec<usize> = Vec::new();
    named_sse(pieces, move |piece, ids| {
        let mut out = Vec::new();
        let stop = |index: usize| {
            (
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            )
        };
        // Starts a block: the one open before it stops.
        let mut begin = |out: &mut Vec<(&'static str, Value)>, block: Value| {
            out.extend(open.replace(blocks).map(stop));
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": blocks, "content_block": block}),
            ));
            blocks += 1;
            blocks - 1
        };
        if !started {
            started = true;
            out.push((
                "message_start",
                json!({"type": "message_start", "message": {
                "id": reply.id, "type": "message", "role": "assistant", "model": reply.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0}}}),
            ));
            if reply.thinking {
                begin(
                    &mut out,
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                );
            } else {
                text_block = Some(begin(&mut out, json!({"type": "text", "text": ""})));
            }
        }
        match piece {
            // The stream ends at an error event, as Anthropic's do.
            Err(e) => out.push((
                "error",
                json!({"type": "error", "error": {
                "type": "api_error", "message": e.body()["error"]["message"]}}),
            )),
            Ok(Piece::Delta {
                text,
                reasoning,
                ids: new,
                ..
            }) => {
                if !reasoning.is_empty() && reply.thinking && text_block.is_none() {
                    out.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "thinking_delta", "thinking": reasoning}}),
                    ));
                }
                if !text.is_empty() {
                    let index = match text_block {
                        Some(i) => i,
                        None => {
                            *text_block.insert(begin(&mut out, json!({"type": "text", "text": ""})))
                        }
                    };
                    out.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta",
                        "index": index, "delta": {"type": "text_delta", "text": text}}),
                    ));
                }
                let (Some(fmt), Some(tools)) = (state.chat.as_ref(), reply.tools.as_ref()) else {
                    return out;
                };
                for entry in calls.push(fmt, &state.codec, tools, &new) {
                    let function = &entry["function"];
                    if entry.get("id").is_some() {
                        let block = json!({"type": "tool_use", "id": entry["id"],
                            "name": function["name"], "input": {}});
                        call_blocks.push(begin(&mut out, block));
                    } else {
                        let call = entry["index"].as_u64().unwrap_or(0) as usize;
                        let Some(&index) = call_blocks.get(call) else {
                            continue; // a call's start comes before its input
                        };
                        out.push((
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta",
                            "partial_json": function["arguments"]}}),
                        ));
                    }
                }
            }
            Ok(Piece::Done(o)) => {
                out.extend(open.take().map(stop));
                let (reason, sequence) =
                    stop_reason(&o, &tool_calls(&state, reply.tools.as_ref(), ids));
                out.push((
                    "message_delta",
                    json!({"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(&o)}),
                ));
                out.push(("message_stop", json!({"type": "message_stop"})));
            }
        }
        out
    })
}
