//! Structured outputs: a JSON schema (OpenAI's `response_format`, the Responses API's
//! `text.format`) compiled by llguidance (the grammar engine vLLM and SGLang use) into a
//! matcher that masks, at each step, the tokens that cannot continue a valid document.
//! kiln's vocabulary goes to llguidance as each token's bytes (special tokens marked, so
//! no text ever matches them); the scheduler applies the masks ([`Constraint`]).
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::chat_format::KimiFormat;
use super::error::ApiError;
use super::tools::{Forced, Tools};
use super::AppState;
use crate::model::tokenizer::TextCodec;
use crate::scheduler::constraint::{Allowed, Constraint};

/// The vocabulary as llguidance sees it.
struct Vocabulary {
    trie: TokTrie,
    codec: Arc<TextCodec>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.codec
            .encode_plain(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// Compiles grammars over one model's vocabulary.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// The token llguidance allows where a document may end (the scheduler then allows
    /// the request's stop tokens instead).
    end: u32,
}

impl Grammars {
    /// Grammars over `codec`'s tokens in a model of `vocab_size` logits (ids past the
    /// tokenizer's are never allowed); `end` is a special token that stands for the end.
    pub fn new(codec: Arc<TextCodec>, vocab_size: usize, end: u32) -> Result<Self, String> {
        let specials: std::collections::HashSet<u32> =
            codec.added_tokens().into_iter().map(|(_, id)| id).collect();
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match id as usize >= codec.vocab_size() {
                true => Vec::new(),
                false if specials.contains(&id) => {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &codec.token_bytes(id)].concat()
                }
                false => codec.token_bytes(id),
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, end), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(Vocabulary { trie, codec });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars {
            factory: Arc::new(factory),
            end,
        })
    }

    /// The grammar of documents that match JSON schema `schema`; `Err` says why the schema
    /// cannot be compiled (checked here, before any request runs with it). Documents are
    /// laid out as [`laid_out`] says.
    pub fn json_schema(&self, schema: Value) -> Result<Grammar, String> {
        self.compile(TopLevelGrammar::from_json_schema(laid_out(schema)))
    }

    /// The grammar of a reply forced into a tool call, from where its forced prefix ends
    /// ([`KimiFormat::forced_prefix`]): a named tool's arguments matching its `parameters`
    /// schema, then the call's and the section's end; or, forced to call any tool, one or
    /// more calls of declared tools, each its id (`functions.NAME:IDX`) and arguments
    /// matching that tool's schema, then the section's end.
    pub fn forced_calls(&self, fmt: &KimiFormat, tools: &Tools) -> Result<Grammar, String> {
        let [_, call_begin, argument_begin, call_end] = fmt.call_markers();
        let section_end = fmt.section_end();
        let declared = tools.declared.as_array().cloned().unwrap_or_default();
        let schema = |tool: &Value| {
            let parameters = tool.pointer("/function/parameters").cloned();
            laid_out(parameters.unwrap_or_else(|| serde_json::json!({"type": "object"})))
        };
        let lark = match &tools.forced {
            Some(Forced::Named(n)) => {
                let tool = (declared.iter().find(|t| name(t) == Some(n.as_str())))
                    .ok_or_else(|| format!("no declared tool is named {n}"))?;
                format!(
                    "start: args <[{call_end}]> <[{section_end}]>\nargs: %json {}\n",
                    schema(tool)
                )
            }
            Some(Forced::Any) => {
                let mut lark = format!("start: call+ <[{section_end}]>\ncall: ");
                let alternatives: Vec<String> =
                    (0..declared.len()).map(|i| format!("call_{i}")).collect();
                lark.push_str(&alternatives.join(" | "));
                lark.push('\n');
                for (i, tool) in declared.iter().enumerate() {
                    let id = Value::from(format!("functions.{}:", name(tool).unwrap_or("")));
                    lark.push_str(&format!(
                        "call_{i}: <[{call_begin}]> {id} /[0-9]+/ <[{argument_begin}]> args_{i} \
                         <[{call_end}]>\nargs_{i}: %json {}\n",
                        schema(tool)
                    ));
                }
                lark
            }
            None => return Err("no tool call is forced".into()),
        };
        self.compile(TopLevelGrammar::from_lark(lark))
    }

    /// `grammar` checked by starting a matcher on it.
    fn compile(&self, grammar: TopLevelGrammar) -> Result<Grammar, String> {
        let g = Grammar {
            factory: self.factory.clone(),
            grammar,
            end: self.end,
        };
        g.start()?;
        Ok(g)
    }
}

/// A declared tool's name.
fn name(tool: &Value) -> Option<&str> {
    tool.pointer("/function/name").and_then(Value::as_str)
}

/// `schema` with its documents laid out as Python's `json.dumps` writes them (`", "` and
/// `": "`, no other whitespace), unless it sets llguidance's layout (`x-guidance`) itself:
/// with free whitespace a model can pad a document until it runs out of tokens.
fn laid_out(mut schema: Value) -> Value {
    if let Some(root) = schema.as_object_mut() {
        root.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false,
                               "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// The grammar an output `format` asks for (`field` names it in errors): none for
/// `{"type": "text"}`, any JSON object for `json_object`, and for `json_schema` its schema,
/// as chat's `response_format` nests it (`{"json_schema": {"schema": ...}}`) or as the
/// Responses API's `text.format` holds it (`{"schema": ...}`).
pub(super) fn output_format(
    state: &AppState,
    format: Option<&Value>,
    field: &'static str,
) -> Result<Option<Grammar>, ApiError> {
    let invalid = |m: String| ApiError::invalid(m, Some(field));
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let schema = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => serde_json::json!({"type": "object"}),
        Some("json_schema") => {
            let schema = (format.pointer("/json_schema/schema")).or_else(|| format.get("schema"));
            schema
                .cloned()
                .ok_or_else(|| invalid("a json_schema format needs its schema".into()))?
        }
        _ => {
            return Err(invalid(format!(
                "type must be text, json_object or json_schema, got {format}"
            )))
        }
    };
    let grammars = (state.grammars.as_ref())
        .ok_or_else(|| invalid("structured outputs are unavailable for this model".into()))?;
    grammars
        .json_schema(schema)
        .map(Some)
        .map_err(|e| invalid(format!("the schema cannot be followed: {e}")))
}

/// A compiled grammar: each request that follows it gets its own matcher.
#[derive(Clone)]
pub struct Grammar {
    factory: Arc<ParserFactory>,
    grammar: TopLevelGrammar,
    end: u32,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// A matcher at the grammar's start.
    pub fn start(&self) -> Result<Box<dyn Constraint>, String> {
        let parser = self.factory.create_parser(self.grammar.clone());
        let matcher = Matcher::new(parser);
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Box::new(Following {
            matcher,
            end: self.end,
        }))
    }
}

/// A request's matcher.
struct Following {
    matcher: Matcher,
    end: u32,
}

impl std::fmt::Debug for Following {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Following a grammar")
    }
}

impl Constraint for Following {
    fn allowed(&mut self) -> Result<Allowed, String> {
        if self.matcher.is_stopped() && !self.matcher.is_error() {
            // The document is complete: only its end may follow.
            return Ok(Allowed {
                words: Vec::new(),
                may_end: true,
            });
        }
        let mask = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        Ok(Allowed {
            words: mask.as_slice().to_vec(),
            may_end: mask.is_allowed(self.end),
        })
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::default_model;

    fn grammars() -> (Arc<TextCodec>, Grammars) {
        let codec = Arc::new(default_model::codec());
        let g = Grammars::new(codec.clone(), 512, 1).unwrap();
        (codec, g)
    }

    /// Walks `text`'s tokens through a matcher: each must be allowed where it comes.
    fn follows(g: &Grammar, codec: &TextCodec, text: &str) -> Result<bool, String> {
        let mut m = g.start()?;
        for t in codec.encode_plain(text)? {
            let allowed = m.allowed()?;
            if !allowed.allows(t) {
                return Ok(false);
            }
            m.accept(t)?;
        }
        Ok(m.allowed()?.may_end)
    }

    #[test]
    fn a_schemas_documents_are_allowed_token_by_token_and_others_are_not() {
        let (codec, g) = grammars();
        let schema = serde_json::json!({"type": "object", "required": ["n"],
            "properties": {"n": {"type": "integer"}}, "additionalProperties": false});
        let g = g.json_schema(schema).unwrap();
        assert_eq!(follows(&g, &codec, r#"{"n": 12}"#), Ok(true));
        assert_eq!(
            follows(&g, &codec, r#"{"n":  12}"#),
            Ok(false),
            "one space only"
        );
        assert_eq!(follows(&g, &codec, r#"{"n": "12"}"#), Ok(false));
        assert_eq!(
            follows(&g, &codec, r#"{"n": 1"#),
            Ok(false),
            "incomplete: may not end"
        );
        assert_eq!(follows(&g, &codec, r#"{"m": 1}"#), Ok(false));
    }

    #[test]
    fn no_special_token_is_ever_allowed_inside_a_document() {
        let (codec, g) = grammars();
        let g = g
            .json_schema(serde_json::json!({"type": "string"}))
            .unwrap();
        let mut m = g.start().unwrap();
        for t in codec.encode_plain("\"a").unwrap() {
            m.accept(t).unwrap();
        }
        let allowed = m.allowed().unwrap();
        for (s, id) in codec.added_tokens() {
            assert!(!allowed.allows(id), "{s} allowed inside a string");
        }
        assert!(!allowed.may_end);
    }

    /// Walks `text` (special-token strings as tokens) through a forced call's grammar.
    fn calls(g: &Grammar, codec: &TextCodec, text: &str) -> Result<bool, String> {
        let mut m = g.start()?;
        for t in codec.encode(text)? {
            if !m.allowed()?.allows(t) {
                return Ok(false);
            }
            m.accept(t)?;
        }
        Ok(m.is_complete())
    }

    #[test]
    fn a_forced_call_names_a_declared_tool_with_arguments_of_its_schema() {
        let (codec, g) = grammars();
        let fmt = KimiFormat::new(&codec).unwrap();
        let declared = serde_json::json!([
            {"type": "function", "function": {"name": "ls", "parameters": {"type": "object",
                "properties": {"path": {"type": "string"}}, "required": ["path"],
                "additionalProperties": false}}},
            {"type": "function", "function": {"name": "pwd"}}]);
        let any = crate::server::tools::resolve(Some(&declared), Some(&"required".into()))
            .unwrap()
            .unwrap();
        let g_any = g.forced_calls(&fmt, &any).unwrap();
        let call = |name: &str, i: usize, args: &str| {
            format!("<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>")
        };
        let end = "<|tool_calls_section_end|>";
        let ls = call("ls", 0, r#"{"path": "."}"#);
        assert_eq!(calls(&g_any, &codec, &format!("{ls}{end}")), Ok(true));
        let two = format!("{ls}{}{end}", call("pwd", 1, "{}"));
        assert_eq!(calls(&g_any, &codec, &two), Ok(true), "two calls");
        let undeclared = format!("{}{end}", call("rm", 0, "{}"));
        assert_eq!(calls(&g_any, &codec, &undeclared), Ok(false));
        let bad_args = format!("{}{end}", call("ls", 0, r#"{"path": 1}"#));
        assert_eq!(calls(&g_any, &codec, &bad_args), Ok(false));
        assert_eq!(calls(&g_any, &codec, end), Ok(false), "at least one call");

        let choice = serde_json::json!({"type": "function", "function": {"name": "ls"}});
        let named = crate::server::tools::resolve(Some(&declared), Some(&choice))
            .unwrap()
            .unwrap();
        let g_named = g.forced_calls(&fmt, &named).unwrap();
        let args = format!(r#"{{"path": "src"}}<|tool_call_end|>{end}"#);
        assert_eq!(calls(&g_named, &codec, &args), Ok(true));
        assert_eq!(
            calls(&g_named, &codec, &format!("{{}}<|tool_call_end|>{end}")),
            Ok(false)
        );
    }

    #[test]
    fn a_schema_that_cannot_compile_is_refused() {
        let (_, g) = grammars();
        let bad = serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#/nope"}}});
        assert!(g.json_schema(bad).is_err());
    }
}
