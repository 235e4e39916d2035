//! Kimi's chat format (ANCHORS.md): its special tokens, tool calls parsed back out of
//! generated ids into OpenAI `tool_calls`, and (in tests) the conversation written out by
//! hand, the oracle of the template the server renders ([`super::chat_template`]).
//!
//! ```text
//! <|im_system|>tool_declare<|im_middle|>[tools json]<|im_end|>
//! <|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>
//! <|im_assistant|>assistant<|im_middle|>...<|tool_calls_section_begin|>
//!   <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
//! <|tool_calls_section_end|><|im_end|>
//! <|im_system|>tool<|im_middle|>## Return of functions.NAME:IDX\n...<|im_end|>
//! <|im_assistant|>assistant<|im_middle|>            (the generation prompt)
//! ```
use serde::{Deserialize, Serialize};

use super::tools::Forced;
use crate::model::tokenizer::TextCodec;

/// A chat message as OpenAI's API sends it (with a thinking model's reasoning on an
/// assistant turn, as DeepSeek's API names it or as `reasoning`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default, alias = "reasoning")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// Bytes of text this message renders from (content, tool calls, the call it answers).
    pub fn text_bytes(&self) -> usize {
        let content = match &self.content {
            None => 0,
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|p| p.text.as_ref())
                .map(String::len)
                .sum(),
        };
        let calls: usize = (self.tool_calls.iter().flatten())
            .map(|c| c.id.len() + c.function.name.len() + c.function.arguments.len())
            .sum();
        let reasoning = self.reasoning_content.as_ref().map_or(0, String::len);
        self.role.len()
            + content
            + calls
            + self.tool_call_id.as_ref().map_or(0, String::len)
            + reasoning
    }
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// An OpenAI tool call.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as OpenAI sends it.
    pub arguments: String,
}

const TOKENS: [&str; 10] = [
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
];

/// The ids of the format's special tokens in one tokenizer.
#[derive(Clone, Debug)]
pub struct KimiFormat {
    end: u32,
    section_begin: u32,
    section_end: u32,
    call_begin: u32,
    argument_begin: u32,
    call_end: u32,
}

impl KimiFormat {
    /// The format over `codec`'s vocabulary; `Err` names the special tokens it lacks.
    pub fn new(codec: &TextCodec) -> Result<Self, String> {
        let ids: Vec<Option<u32>> = TOKENS.iter().map(|t| codec.token_id(t)).collect();
        let missing: Vec<&str> = (TOKENS.iter().zip(&ids))
            .filter(|(_, id)| id.is_none())
            .map(|(t, _)| *t)
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the tokenizer lacks Kimi's chat tokens {missing:?}"
            ));
        }
        let id = |i: usize| ids[i].expect("checked above");
        Ok(KimiFormat {
            end: id(0),
            section_begin: id(5),
            section_end: id(6),
            call_begin: id(7),
            argument_begin: id(8),
            call_end: id(9),
        })
    }

    /// The token that starts a tool-call section (the content ends there).
    pub fn section_begin(&self) -> u32 {
        self.section_begin
    }

    /// The token that ends a tool-call section.
    pub fn section_end(&self) -> u32 {
        self.section_end
    }

    /// The tool-call markers: section begin, call begin, argument begin, call end.
    pub fn call_markers(&self) -> [u32; 4] {
        [
            self.section_begin,
            self.call_begin,
            self.argument_begin,
            self.call_end,
        ]
    }

    /// The ids a reply forced to call a tool starts with (appended to the prompt): the
    /// section's start, and for a named tool its call up to the arguments.
    pub fn forced_prefix(&self, codec: &TextCodec, forced: &Forced) -> Vec<u32> {
        let mut ids = vec![self.section_begin];
        if let Forced::Named(name) = forced {
            ids.push(self.call_begin);
            ids.extend(
                codec
                    .encode_plain(&format!("functions.{name}:0"))
                    .unwrap_or_default(),
            );
            ids.push(self.argument_begin);
        }
        ids
    }

    /// `<|im_end|>`: the end of a turn, so the end of a chat reply.
    pub fn turn_end(&self) -> u32 {
        self.end
    }

    /// Where the tool-call section starts in generated ids (the content is before it).
    pub fn section_start(&self, ids: &[u32]) -> Option<usize> {
        ids.iter().position(|&t| t == self.section_begin)
    }

    /// The complete tool calls in a generated tool-call section (`ids` from its start).
    pub fn parse_calls(&self, codec: &TextCodec, ids: &[u32]) -> Vec<ToolCall> {
        let mut calls = Vec::new();
        let mut rest = ids;
        while let Some(b) = rest.iter().position(|&t| t == self.call_begin) {
            rest = &rest[b + 1..];
            let Some(a) = rest.iter().position(|&t| t == self.argument_begin) else {
                break;
            };
            let Some(e) = rest[a..].iter().position(|&t| t == self.call_end) else {
                break;
            };
            let id = codec
                .decode(&rest[..a])
                .unwrap_or_default()
                .trim()
                .to_string();
            let arguments = codec.decode(&rest[a + 1..a + e]).unwrap_or_default();
            calls.push(ToolCall {
                function: FunctionCall {
                    name: function_name(&id),
                    arguments: arguments.trim().to_string(),
                },
                id,
                kind: function_type(),
            });
            rest = &rest[a + e + 1..];
        }
        calls
    }
}

/// Token ids of a conversation in Kimi's format followed by the generation prompt, written out by
/// hand: the oracle the served template ([`super::chat_template::KIMI_TEMPLATE`]) is
/// tested against. Text between two special tokens is encoded as one plain string, as
/// a rendered template's is.
#[cfg(test)]
pub(super) fn render_by_hand(
    codec: &TextCodec,
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
) -> Result<Vec<u32>, String> {
    enum Piece {
        Special(u32),
        Text(String),
    }
    use Piece::{Special, Text};
    let id = |t: &str| codec.token_id(t).ok_or(format!("no {t} in the vocabulary"));
    let (end, middle) = (id("<|im_end|>")?, id("<|im_middle|>")?);
    let (user, assistant, system) = (
        id("<|im_user|>")?,
        id("<|im_assistant|>")?,
        id("<|im_system|>")?,
    );
    let (section_begin, section_end) = (
        id("<|tool_calls_section_begin|>")?,
        id("<|tool_calls_section_end|>")?,
    );
    let (call_begin, argument_begin, call_end) = (
        id("<|tool_call_begin|>")?,
        id("<|tool_call_argument_begin|>")?,
        id("<|tool_call_end|>")?,
    );
    let mut pieces = Vec::new();
    let open = |pieces: &mut Vec<Piece>, who: u32, role: &str| {
        pieces.extend([Special(who), Text(role.into()), Special(middle)]);
    };
    if let Some(tools) = tools.filter(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
        open(&mut pieces, system, "tool_declare");
        pieces.extend([Text(tools.to_string()), Special(end)]);
    }
    for (i, m) in messages.iter().enumerate() {
        let content =
            content_text(m.content.as_ref()).map_err(|e| format!("messages[{i}]: {e}"))?;
        match m.role.as_str() {
            "system" | "developer" => open(&mut pieces, system, "system"),
            "user" => open(&mut pieces, user, "user"),
            "assistant" => open(&mut pieces, assistant, "assistant"),
            "tool" => {
                open(&mut pieces, system, "tool");
                let call = m.tool_call_id.as_deref().unwrap_or("");
                pieces.push(Text(format!("## Return of {call}\n")));
            }
            other => return Err(format!("messages[{i}]: unknown role `{other}`")),
        }
        pieces.push(Text(content));
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            pieces.push(Special(section_begin));
            for c in calls {
                pieces.extend([
                    Special(call_begin),
                    Text(c.id.clone()),
                    Special(argument_begin),
                    Text(c.function.arguments.clone()),
                    Special(call_end),
                ]);
            }
            pieces.push(Special(section_end));
        }
        pieces.push(Special(end));
    }
    open(&mut pieces, assistant, "assistant");
    let (mut ids, mut text) = (Vec::new(), String::new());
    for p in pieces {
        match p {
            Text(t) => text.push_str(&t),
            Special(id) => {
                ids.extend(codec.encode_plain(&std::mem::take(&mut text))?);
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// `NAME` of a Kimi call id `functions.NAME:IDX`.
pub fn function_name(id: &str) -> String {
    let name = id.strip_prefix("functions.").unwrap_or(id);
    match name.rsplit_once(':') {
        Some((n, idx)) if idx.chars().all(|c| c.is_ascii_digit()) => n.to_string(),
        _ => name.to_string(),
    }
}

pub(super) fn content_text(c: Option<&Content>) -> Result<String, String> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.as_str()),
                (kind, _) => Err(format!("content part of type `{kind}` is not supported")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codec() -> TextCodec {
        crate::model::default_model::codec()
    }

    #[test]
    fn generated_tool_calls_parse_into_openai_calls() {
        let c = codec();
        let f = KimiFormat::new(&c).unwrap();
        let out = c
            .encode("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{\"path\": \"a.rs\"}<|tool_call_end|><|tool_call_begin|>functions.ls:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
            .unwrap();
        let start = f.section_start(&out).unwrap();
        assert_eq!(c.decode(&out[..start]).unwrap(), "Let me look.");
        let calls = f.parse_calls(&c, &out[start..]);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].id, "functions.read_file:0");
        assert_eq!(calls[0].function.name, "read_file");
        assert_eq!(calls[0].function.arguments, "{\"path\": \"a.rs\"}");
        assert_eq!(calls[1].function.name, "ls");
    }

    #[test]
    fn a_call_cut_off_by_max_tokens_is_not_reported() {
        let c = codec();
        let f = KimiFormat::new(&c).unwrap();
        let out = c
            .encode("<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>{\"pa")
            .unwrap();
        assert!(f.parse_calls(&c, &out).is_empty());
    }
}
