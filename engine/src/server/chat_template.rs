//! Chat templates as checkpoints ship them: the `chat_template` of `tokenizer_config.json`
//! (Jinja) rendered as transformers renders it (`trim_blocks`, `lstrip_blocks`, loop
//! controls, Python's string and dict methods, and HF's globals: `raise_exception`,
//! `strftime_now`, and a `tojson` that writes what Python's `json.dumps` writes), then
//! tokenized with the template's own special tokens as tokens.
//!
//! What the request supplies cannot become a special token: every special-token string in
//! message text, tool calls or tool declarations is marked before rendering (a private-use
//! character after its first character), so it no longer matches; after rendering, the
//! text between the template's own special tokens is unmarked and encoded as plain text.
//!
//! A tokenizer with Kimi's chat tokens and no template of its own gets [`KIMI_TEMPLATE`],
//! Kimi's format as ANCHORS.md gives it ([`super::chat_format::KimiFormat`]'s oracle renders
//! the same ids).
use aho_corasick::{AhoCorasick, MatchKind};
use minijinja::value::Value;
use minijinja::{Environment, Error, ErrorKind};

use super::chat_format::{content_text, ChatMessage};
use crate::model::tokenizer::TextCodec;

/// Kimi's chat format as a template (ANCHORS.md): tools declared first, each message a
/// turn, past tool calls in their section, a tool result headed by the call it answers.
pub const KIMI_TEMPLATE: &str = include_str!("kimi_chat.jinja");

/// The private-use character that breaks a special-token string supplied by a request.
const MARK: char = '\u{E000}';

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    eos_id: Option<u32>,
    /// The ids of the special tokens, and automata over their strings (patterns in the
    /// same order): the leftmost longest match (a rendered prompt's tokens) and every
    /// match (what to mark).
    special_ids: Vec<u32>,
    leftmost: AhoCorasick,
    every: AhoCorasick,
}

impl ChatTemplate {
    /// Compiles `source` for `codec`'s vocabulary; `Err` says where the template is invalid.
    pub fn new(source: &str, codec: &TextCodec) -> Result<Self, String> {
        let mut env = Environment::new();
        let mut syntax = minijinja::syntax::SyntaxConfig::builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(|e| e.to_string())?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", super::tojson::tojson);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("the chat template does not compile: {e:#}"))?;
        let mut specials = codec.added_tokens();
        specials.retain(|(s, _)| !s.is_empty());
        let strings = specials.iter().map(|(s, _)| s.as_str());
        let leftmost = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(strings.clone())
            .map_err(|e| e.to_string())?;
        let every = AhoCorasick::new(strings).map_err(|e| e.to_string())?;
        Ok(ChatTemplate {
            special_ids: specials.iter().map(|(_, id)| *id).collect(),
            leftmost,
            every,
            env,
            bos_token: codec.bos_token.clone().unwrap_or_default(),
            eos_token: codec.eos_token.clone().unwrap_or_default(),
            eos_id: codec.eos_token.as_deref().and_then(|t| codec.token_id(t)),
        })
    }

    /// The id of `eos_token`, where a reply in this format ends.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// The template's text for `messages` (and the tools on offer), ending in the
    /// generation prompt; special-token strings the request supplied come out marked.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, String> {
        let messages = self.mark(template_messages(messages)?);
        let tools = tools
            .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
            .map(|t| self.mark(t.clone()));
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(&messages)),
            tools => Value::from(minijinja::value::Serde(&tools)),
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let template = self.env.get_template("chat").expect("added in new");
        template.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_string(),
            _ => format!("the chat template failed: {e:#}"),
        })
    }

    /// Token ids of rendered text: the template's special tokens as their ids, the text
    /// between them unmarked and encoded as plain text.
    fn encode(&self, codec: &TextCodec, rendered: &str) -> Result<Vec<u32>, String> {
        let (mut ids, mut at) = (Vec::new(), 0);
        for m in self.leftmost.find_iter(rendered) {
            ids.extend(codec.encode_plain(&unmark(&rendered[at..m.start()]))?);
            ids.push(self.special_ids[m.pattern().as_usize()]);
            at = m.end();
        }
        ids.extend(codec.encode_plain(&unmark(&rendered[at..]))?);
        Ok(ids)
    }

    /// The prompt's ids: [`Self::render`] then [`Self::encode`].
    pub fn prompt(
        &self,
        codec: &TextCodec,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>, String> {
        self.encode(codec, &self.render(messages, tools)?)
    }

    /// `value` with every string's special-token strings broken by [`MARK`] (and marks
    /// already there doubled, so unmarking gives the text back).
    fn mark(&self, value: serde_json::Value) -> serde_json::Value {
        use serde_json::Value as J;
        match value {
            J::String(s) => J::String(self.mark_text(&s)),
            J::Array(items) => J::Array(items.into_iter().map(|v| self.mark(v)).collect()),
            J::Object(map) => J::Object(map.into_iter().map(|(k, v)| (k, self.mark(v))).collect()),
            other => other,
        }
    }

    fn mark_text(&self, s: &str) -> String {
        // Where a special-token string starts (overlapping ones too): a mark goes after
        // the character there.
        let starts: std::collections::BTreeSet<usize> = self
            .every
            .find_overlapping_iter(s)
            .map(|m| m.start())
            .collect();
        let mut out = String::with_capacity(s.len() + starts.len() * MARK.len_utf8());
        for (i, c) in s.char_indices() {
            out.push(c);
            if c == MARK || starts.contains(&i) {
                out.push(MARK);
            }
        }
        out
    }
}

/// The messages as templates read them: each a role, its content as one string (text parts
/// joined), and its tool calls, the call it answers and its reasoning when it has them. `Err` names a
/// message with an unknown role or content a text model cannot read.
fn template_messages(messages: &[ChatMessage]) -> Result<serde_json::Value, String> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        ) {
            return Err(format!("messages[{i}]: unknown role `{}`", m.role));
        }
        let content =
            content_text(m.content.as_ref()).map_err(|e| format!("messages[{i}]: {e}"))?;
        let mut v = serde_json::json!({"role": m.role, "content": content});
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_empty()) {
            v["tool_calls"] = serde_json::to_value(calls).map_err(|e| e.to_string())?;
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = id.clone().into();
        }
        if let Some(r) = &m.reasoning_content {
            v["reasoning_content"] = r.clone().into();
        }
        out.push(v);
    }
    Ok(out.into())
}

/// Marked text back as the request sent it: a doubled mark is one, a single one is dropped.
fn unmark(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != MARK {
            out.push(c);
        } else if chars.peek() == Some(&MARK) {
            out.push(MARK);
            chars.next();
        }
    }
    out
}

/// The time now (UTC) formatted by a strftime `format` (the subset templates use: %Y %m %d %B
/// %b %A %a %H %M %S %%).
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let weekday = (secs.div_euclid(86_400) + 4).rem_euclid(7) as usize; // 1970-01-01: Thursday
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", sod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::server::chat_format::{
        render_by_hand, Content, ContentPart, FunctionCall, ToolCall,
    };

    fn codec() -> TextCodec {
        crate::model::default_model::codec()
    }

    fn kimi(c: &TextCodec) -> ChatTemplate {
        ChatTemplate::new(KIMI_TEMPLATE, c).unwrap()
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(Content::Text(content.into())),
            ..Default::default()
        }
    }

    #[test]
    fn a_conversation_renders_as_kimi_turns_ending_in_the_generation_prompt() {
        let c = codec();
        let t = kimi(&c);
        let ids = t
            .prompt(&c, &[msg("system", "Be brief."), msg("user", "Hi")], None)
            .unwrap();
        let text = c.decode_with_special(&ids).unwrap();
        assert_eq!(
            text,
            "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi\
             <|im_end|><|im_assistant|>assistant<|im_middle|>"
        );
    }

    #[test]
    fn special_tokens_typed_by_a_user_stay_text() {
        let c = codec();
        let t = kimi(&c);
        let ids = t.prompt(&c, &[msg("user", "<|im_end|>")], None).unwrap();
        let ends = ids
            .iter()
            .filter(|&&t| Some(t) == c.token_id("<|im_end|>"))
            .count();
        assert_eq!(ends, 1, "only the turn's own end token: {ids:?}");
    }

    #[test]
    fn tools_are_declared_and_past_calls_and_results_rendered() {
        let c = codec();
        let t = kimi(&c);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "ls"}}]);
        let mut call = msg("assistant", "");
        call.tool_calls = Some(vec![ToolCall {
            id: "functions.ls:0".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "ls".into(),
                arguments: "{\"path\":\".\"}".into(),
            },
        }]);
        let mut result = msg("tool", "README.md");
        result.tool_call_id = Some("functions.ls:0".into());
        let ids = t
            .prompt(&c, &[msg("user", "list"), call, result], Some(&tools))
            .unwrap();
        let text = c.decode_with_special(&ids).unwrap();
        assert!(text.starts_with(
            "<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\",\"function\":{\"name\":\"ls\"}}]<|im_end|>"
        ), "{text}");
        assert!(text.contains(
            "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>{\"path\":\".\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        ), "{text}");
        assert!(text.contains(
            "<|im_system|>tool<|im_middle|>## Return of functions.ls:0\nREADME.md<|im_end|>"
        ));
    }

    #[test]
    fn image_parts_are_refused_with_the_message_index() {
        let c = codec();
        let t = kimi(&c);
        let m = ChatMessage {
            content: Some(Content::Parts(vec![ContentPart {
                kind: "image_url".into(),
                text: None,
            }])),
            ..msg("user", "")
        };
        let err = t.prompt(&c, &[m], None).unwrap_err();
        assert!(
            err.contains("messages[0]") && err.contains("image_url"),
            "{err}"
        );
    }

    /// Text a request may send: words, whitespace runs, Kimi's special-token strings, the
    /// private-use mark itself, quotes and non-ASCII.
    fn text() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            "[a-z]{1,6}",
            Just(" ".to_string()),
            Just("\n\n".to_string()),
            Just("<|im_end|>".to_string()),
            Just("<|tool_call_begin|>".to_string()),
            Just("<|im_".to_string()),
            Just(MARK.to_string()),
            Just("\"é∑".to_string()),
        ];
        proptest::collection::vec(piece, 0..6).prop_map(|p| p.concat())
    }

    fn message() -> impl Strategy<Value = ChatMessage> {
        let role = prop_oneof![
            Just("system"),
            Just("developer"),
            Just("user"),
            Just("assistant"),
            Just("tool")
        ];
        (
            role,
            text(),
            text(),
            proptest::collection::vec((text(), text()), 0..3),
        )
            .prop_map(|(role, content, extra, calls)| {
                let mut m = msg(role, &content);
                if role == "assistant" {
                    m.tool_calls = Some(
                        (calls.into_iter().enumerate())
                            .map(|(i, (name, arguments))| ToolCall {
                                id: format!("functions.{name}:{i}"),
                                kind: "function".into(),
                                function: FunctionCall { name, arguments },
                            })
                            .collect(),
                    );
                }
                if role == "tool" {
                    m.tool_call_id = Some(extra);
                }
                m
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// The served template and the format written out by hand give the same ids for
        /// any conversation, whatever special-token strings the request carries.
        #[test]
        fn kimis_template_renders_what_the_hand_written_format_does(
            messages in proptest::collection::vec(message(), 0..5),
            tool in proptest::option::of(text()),
        ) {
            let c = codec();
            let tools = tool.map(|d| serde_json::json!([{"type": "function",
                "function": {"name": "f", "description": d}}]));
            let served = kimi(&c).prompt(&c, &messages, tools.as_ref()).unwrap();
            let by_hand = render_by_hand(&c, &messages, tools.as_ref()).unwrap();
            prop_assert_eq!(served, by_hand);
        }

        /// Marking and unmarking give a request's text back exactly.
        #[test]
        fn unmarking_undoes_marking(s in text()) {
            let t = kimi(&codec());
            let marked = t.mark_text(&s);
            let specials = codec().added_tokens();
            prop_assert!(specials.iter().all(|(sp, _)| !marked.contains(sp.as_str())));
            prop_assert_eq!(unmark(&marked), s);
        }
    }

    #[test]
    fn an_unknown_role_is_refused_with_its_index() {
        let c = codec();
        let err = kimi(&c)
            .prompt(&c, &[msg("user", "a"), msg("robot", "b")], None)
            .unwrap_err();
        assert_eq!(err, "messages[1]: unknown role `robot`");
    }

    #[test]
    fn raise_exception_reports_the_templates_message() {
        let c = codec();
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first a user') }}{% endif %}",
            &c,
        )
        .unwrap();
        assert_eq!(
            t.render(&[msg("system", "x")], None).unwrap_err(),
            "first a user"
        );
    }

    #[test]
    fn a_template_that_does_not_compile_is_refused_at_load() {
        let err = ChatTemplate::new("{% for m in messages %}", &codec())
            .err()
            .unwrap();
        assert!(err.contains("does not compile"), "{err}");
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let c = codec();
        let render = |src: &str| {
            let t = ChatTemplate::new(src, &c).unwrap();
            let tools = serde_json::json!([{"b": [1, 2.5, 1e20, true, null], "a": "<é\n\u{1}>"}]);
            t.render(&[], Some(&tools)).unwrap()
        };
        // json.dumps(x), json.dumps(x, separators=(',', ':'), sort_keys=True), json.dumps(x, indent=2),
        // json.dumps(x, ensure_ascii=True), each as Python 3.11 prints it.
        assert_eq!(
            render("{{ tools | tojson }}"),
            r#"[{"b": [1, 2.5, 1e+20, true, null], "a": "<é\n\u0001>"}]"#
        );
        assert_eq!(
            render("{{ tools[0] | tojson(separators=(',', ':'), sort_keys=True) }}"),
            r#"{"a":"<é\n\u0001>","b":[1,2.5,1e+20,true,null]}"#
        );
        assert_eq!(
            render("{{ tools[0].b[:2] | tojson(indent=2) }}"),
            "[\n  1,\n  2.5\n]"
        );
        assert_eq!(
            render("{{ tools[0].a | tojson(ensure_ascii=True) }}"),
            r#""<\u00e9\n\u0001>""#
        );
    }

    #[test]
    fn strftime_now_writes_todays_date() {
        let c = codec();
        let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d %%') }}", &c).unwrap();
        let out = t.render(&[], None).unwrap();
        let (y, m, d) = civil_from_days(
            (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                / 86_400) as i64,
        );
        assert_eq!(out, format!("{y}-{m:02}-{d:02} %"));
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_454), (2026, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
