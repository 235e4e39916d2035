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

use super::error::ApiError;
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
    /// written as Python's `json.dumps` writes them (`", "` and `": "`, no other
    /// whitespace) unless the schema sets llguidance's `x-guidance` options itself: with
    /// free whitespace a model can pad a document until it runs out of tokens.
    pub fn json_schema(&self, mut schema: Value) -> Result<Grammar, String> {
        if let Some(root) = schema.as_object_mut() {
            root.entry("x-guidance").or_insert_with(|| {
                serde_json::json!({"whitespace_flexible": false,
                                   "item_separator": ", ", "key_separator": ": "})
            });
        }
        let g = Grammar {
            factory: self.factory.clone(),
            grammar: TopLevelGrammar::from_json_schema(schema),
            end: self.end,
        };
        g.start()?;
        Ok(g)
    }
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

    #[test]
    fn a_schema_that_cannot_compile_is_refused() {
        let (_, g) = grammars();
        let bad = serde_json::json!({"type": "object", "properties": {"a": {"$ref": "#/nope"}}});
        assert!(g.json_schema(bad).is_err());
    }
}
