//! A thinking model's reasoning split from its answer, as clients expect it
//! (`reasoning_content` beside `content`, DeepSeek's API contract that SGLang and vLLM
//! follow): the reasoning is what the model writes between its think tokens, `<think>` and
//! `</think>` (Kimi K2 Thinking, DeepSeek-R1 and V3.1) or `◁think▷` and `◁/think▷` (Kimi's
//! earlier thinking models), found in the tokenizer.
//!
//! A reply is reasoning from its start when the prompt ends with the opening token (the
//! template opened it) or the reply's first token is that token; it ends at the closing
//! token, or where a tool-call section starts (Kimi's thinking models may call a tool
//! without closing), or with the reply. A reply that does not open with it is all answer.
use std::sync::Arc;

use super::detok::Detokenizer;
use crate::model::tokenizer::TextCodec;

/// The spellings of the think tokens, first match wins.
const PAIRS: [(&str, &str); 2] = [("<think>", "</think>"), ("◁think▷", "◁/think▷")];

/// The tokens that open and close the reasoning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThinkTokens {
    pub open: u32,
    pub close: u32,
}

impl ThinkTokens {
    /// The think tokens of `codec`'s vocabulary, if it has a pair.
    pub fn find(codec: &TextCodec) -> Option<Self> {
        PAIRS.iter().find_map(|(open, close)| {
            Some(ThinkTokens {
                open: codec.token_id(open)?,
                close: codec.token_id(close)?,
            })
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Nothing generated yet: the first token may open the reasoning.
    Start,
    Reasoning,
    Answer,
}

/// Routes a reply's tokens to its reasoning's text until the reasoning ends.
pub struct Reasoning {
    tokens: ThinkTokens,
    /// Where a tool-call section starts: the reasoning ends there too.
    section: Option<u32>,
    phase: Phase,
    detok: Detokenizer,
    text: String,
}

/// Where one generated token's text goes.
#[derive(Debug, PartialEq)]
pub enum Route {
    /// To the reasoning, with the text it completes there.
    Reasoning(String),
    /// To the answer; what the reasoning still held back when this token ended it.
    Answer(String),
}

impl Reasoning {
    /// The split of a reply to `prompt` (whose last token may have opened the reasoning).
    pub fn new(
        codec: Arc<TextCodec>,
        tokens: ThinkTokens,
        section: Option<u32>,
        prompt: &[u32],
    ) -> Self {
        let phase = if prompt.last() == Some(&tokens.open) {
            Phase::Reasoning
        } else {
            Phase::Start
        };
        Reasoning {
            tokens,
            section,
            phase,
            detok: Detokenizer::new(codec, Vec::new(), None),
            text: String::new(),
        }
    }

    /// Where token `id` goes; a token the answer gets is the caller's to detokenize.
    pub fn route(&mut self, id: u32) -> Route {
        match self.phase {
            Phase::Start if id == self.tokens.open => {
                self.phase = Phase::Reasoning;
                Route::Reasoning(String::new())
            }
            Phase::Start | Phase::Answer => {
                self.phase = Phase::Answer;
                Route::Answer(String::new())
            }
            Phase::Reasoning if id == self.tokens.close => {
                self.phase = Phase::Answer;
                Route::Reasoning(self.end())
            }
            Phase::Reasoning if Some(id) == self.section => {
                self.phase = Phase::Answer;
                Route::Answer(self.end())
            }
            Phase::Reasoning => {
                let text = self.detok.push(id);
                self.text.push_str(&text);
                Route::Reasoning(text)
            }
        }
    }

    /// What the reasoning still holds back, when the reply ends inside it.
    pub fn finish(&mut self) -> String {
        if self.phase == Phase::Reasoning {
            self.end()
        } else {
            String::new()
        }
    }

    /// The reasoning's whole text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn end(&mut self) -> String {
        let rest = self.detok.finish();
        self.text.push_str(&rest);
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny model's tokenizer with two of its special tokens respelled as think tokens.
    fn thinking_codec() -> (Arc<TextCodec>, ThinkTokens) {
        let json = include_str!("../../assets/default-model/tokenizer.json")
            .replace("\"[PAD]\"", "\"<think>\"")
            .replace("\"<|im_user|>\"", "\"</think>\"");
        let codec = TextCodec::from_tokenizer(TextCodec::parse(&json).unwrap(), None);
        let tokens = ThinkTokens::find(&codec).expect("a think pair");
        (Arc::new(codec), tokens)
    }

    /// (reasoning, answer) of `ids` generated after `prompt`, the answer's tokens
    /// detokenized by themselves.
    fn split(prompt: &[u32], ids: &[u32], section: Option<u32>) -> (String, String) {
        let (codec, t) = thinking_codec();
        let mut r = Reasoning::new(codec.clone(), t, section, prompt);
        let (mut reasoning, mut answer_ids) = (String::new(), Vec::new());
        for &id in ids {
            match r.route(id) {
                Route::Reasoning(text) => reasoning.push_str(&text),
                Route::Answer(rest) => {
                    reasoning.push_str(&rest);
                    answer_ids.push(id);
                }
            }
        }
        reasoning.push_str(&r.finish());
        assert_eq!(r.text(), reasoning);
        (reasoning, codec.decode(&answer_ids).unwrap())
    }

    #[test]
    fn the_think_tokens_are_found_in_either_spelling_or_not_at_all() {
        let (codec, t) = thinking_codec();
        assert_eq!(Some(t.open), codec.token_id("<think>"));
        assert_eq!(
            ThinkTokens::find(&crate::model::default_model::codec()),
            None
        );
    }

    #[test]
    fn reasoning_opened_by_the_reply_ends_at_the_closing_token() {
        let (codec, t) = thinking_codec();
        let a = codec.encode("Let me think, ünï.").unwrap();
        let b = codec.encode("The answer.").unwrap();
        let ids: Vec<u32> = [vec![t.open], a, vec![t.close], b].concat();
        let (reasoning, answer) = split(&[5], &ids, None);
        assert_eq!(
            (reasoning.as_str(), answer.as_str()),
            ("Let me think, ünï.", "The answer.")
        );
    }

    #[test]
    fn a_prompt_that_opens_the_reasoning_starts_the_reply_inside_it() {
        let (codec, t) = thinking_codec();
        let ids: Vec<u32> = [
            codec.encode("hmm").unwrap(),
            vec![t.close],
            codec.encode("ok").unwrap(),
        ]
        .concat();
        let (reasoning, answer) = split(&[5, t.open], &ids, None);
        assert_eq!((reasoning.as_str(), answer.as_str()), ("hmm", "ok"));
    }

    #[test]
    fn a_reply_that_does_not_open_with_the_token_is_all_answer() {
        let (codec, t) = thinking_codec();
        let ids: Vec<u32> = [
            codec.encode("plain").unwrap(),
            vec![t.open],
            codec.encode("x").unwrap(),
        ]
        .concat();
        let (reasoning, answer) = split(&[5], &ids, None);
        assert_eq!((reasoning.as_str(), answer.as_str()), ("", "plainx"));
    }

    #[test]
    fn a_tool_call_section_or_the_end_of_the_reply_ends_the_reasoning() {
        let (codec, t) = thinking_codec();
        let section = codec.token_id("<|tool_calls_section_begin|>").unwrap();
        let ids: Vec<u32> = [
            vec![t.open],
            codec.encode("call ls").unwrap(),
            vec![section],
        ]
        .concat();
        let (reasoning, answer) = split(&[5], &ids, Some(section));
        assert_eq!((reasoning.as_str(), answer.as_str()), ("call ls", ""));
        let cut: Vec<u32> = [vec![t.open], codec.encode("unfinished é").unwrap()].concat();
        assert_eq!(split(&[5], &cut, None).0, "unfinished é");
    }
}
