//! A reply's tool calls as OpenAI streams them, fed one generated id at a time: each call's
//! header (`index`, `id`, `type`, `function.name`, empty `arguments`) once its Kimi id is
//! complete, then its arguments as they decode. What the deltas add up to is what the whole
//! reply reports ([`KimiFormat::parse_calls`] then [`Tools::accept`]): undeclared tools are
//! skipped, ids rebuilt where malformed, arguments trimmed (leading whitespace is dropped,
//! trailing whitespace held back until more text follows; a partial UTF-8 character too).
use serde_json::{json, Value};

use super::chat_format::{function_name, KimiFormat};
use super::tools::Tools;
use crate::model::tokenizer::TextCodec;

/// Where a reply's generation stands in its tool-call section.
#[derive(Default)]
pub struct CallStream {
    /// Ids the reply starts from that are not generated (a forced call's start, after the
    /// prompt), fed before the first generated one.
    unfed: Vec<u32>,
    in_section: bool,
    /// The ids of the current call's Kimi id, once its begin marker came.
    call_id: Option<Vec<u32>>,
    args: Option<Arguments>,
    /// Calls streamed so far.
    pub streamed: usize,
}

/// The arguments of the call being streamed.
struct Arguments {
    /// `None`: a call of an undeclared tool, not streamed.
    index: Option<usize>,
    ids: Vec<u32>,
    sent: String,
}

impl CallStream {
    /// A stream whose reply starts from `prefix` (empty unless a call is forced).
    pub fn new(prefix: Vec<u32>) -> Self {
        CallStream {
            unfed: prefix,
            ..CallStream::default()
        }
    }

    /// The `tool_calls` delta entries the generated `ids` complete (often none).
    pub fn push(
        &mut self,
        fmt: &KimiFormat,
        codec: &TextCodec,
        tools: &Tools,
        ids: &[u32],
    ) -> Vec<Value> {
        let unfed = std::mem::take(&mut self.unfed);
        (unfed.iter().chain(ids))
            .flat_map(|&id| self.push_one(fmt, codec, tools, id))
            .collect()
    }

    /// The entries generated id `id` completes.
    fn push_one(
        &mut self,
        fmt: &KimiFormat,
        codec: &TextCodec,
        tools: &Tools,
        id: u32,
    ) -> Vec<Value> {
        let [section, begin, arguments, end] = fmt.call_markers();
        if !self.in_section {
            self.in_section = id == section;
            return Vec::new();
        }
        if let Some(args) = self.args.as_mut() {
            if id == end {
                let text = codec.decode(&args.ids).unwrap_or_default();
                let delta = args.delta(text.trim());
                self.args = None;
                return delta.into_iter().collect();
            }
            args.ids.push(id);
            let text = codec.decode(&args.ids).unwrap_or_default();
            let stable = text.trim_start().trim_end_matches('\u{fffd}').trim_end();
            return args.delta(stable).into_iter().collect();
        }
        match self.call_id.as_mut() {
            Some(_) if id == arguments => {
                let kimi = codec
                    .decode(&self.call_id.take().unwrap())
                    .unwrap_or_default();
                let kimi = kimi.trim();
                let name = function_name(kimi);
                let accepted = tools.accept_one(kimi, &name, self.streamed);
                let index = accepted.as_ref().map(|_| self.streamed);
                self.args = Some(Arguments {
                    index,
                    ids: Vec::new(),
                    sent: String::new(),
                });
                let Some(call_id) = accepted else {
                    return Vec::new();
                };
                self.streamed += 1;
                vec![json!({"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}})]
            }
            Some(ids) if id != begin => {
                ids.push(id);
                Vec::new()
            }
            _ => {
                self.call_id = (id == begin).then(Vec::new);
                Vec::new()
            }
        }
    }
}

impl Arguments {
    /// The entry streaming what `text` adds to what was sent (`text` must extend it).
    fn delta(&mut self, text: &str) -> Option<Value> {
        let index = self.index?;
        let more = text
            .strip_prefix(self.sent.as_str())
            .filter(|m| !m.is_empty())?;
        self.sent.push_str(more);
        Some(json!({"index": index, "function": {"arguments": more}}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_add_up_to_the_calls_of_the_whole_reply() {
        let codec = crate::model::default_model::codec();
        let fmt = KimiFormat::new(&codec).unwrap();
        let declared = json!([
            {"type": "function", "function": {"name": "read_file"}},
            {"type": "function", "function": {"name": "ls"}},
        ]);
        let tools = super::super::tools::resolve(Some(&declared), None)
            .unwrap()
            .unwrap();
        let out = codec
            .encode("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|> {\"path\": \"café/a.rs\"} <|tool_call_end|><|tool_call_begin|>functions.rm:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>ls<|tool_call_argument_begin|>{\"all\": true}<|tool_call_end|><|tool_calls_section_end|>")
            .unwrap();
        let whole = tools.accept(fmt.parse_calls(&codec, &out[fmt.section_start(&out).unwrap()..]));
        let mut stream = CallStream::default();
        let mut calls: Vec<Value> = Vec::new();
        for &id in &out {
            for entry in stream.push(&fmt, &codec, &tools, &[id]) {
                let i = entry["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    assert_eq!(entry["function"]["arguments"], "", "a header first");
                    calls.push(entry);
                } else {
                    let more = entry["function"]["arguments"].as_str().unwrap();
                    let args = calls[i]["function"]["arguments"]
                        .as_str()
                        .unwrap()
                        .to_string();
                    calls[i]["function"]["arguments"] = json!(args + more);
                }
            }
        }
        assert_eq!(stream.streamed, 2, "rm is not declared");
        assert_eq!(whole.len(), 2);
        for (c, w) in calls.iter().zip(&whole) {
            assert_eq!(c["id"], w.id);
            assert_eq!(c["function"]["name"], w.function.name);
            assert_eq!(c["function"]["arguments"], w.function.arguments);
        }
        assert_eq!(whole[1].id, "functions.ls:1", "a malformed id rebuilt");
    }
}
