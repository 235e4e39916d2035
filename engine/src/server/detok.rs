//! Generated ids to text, incrementally: each new token yields the text it completes,
//! holding back bytes that are not yet whole characters and the tail that could still
//! become a stop string (so a stop string is never streamed, as OpenAI specifies). An
//! optional end-of-text token (chat: the start of a tool-call section) ends the text: what
//! was held back is released and nothing after it is text or matched against stops.
//!
//! Each token costs O(1) tokenizer work, not O(length): the ids are decoded in a short
//! window (the tokens since the last whole character, after a few tokens of context so
//! tokenizers that drop a leading space see where they are), and only its new characters
//! are appended to the text (the scheme of HF text-generation-inference and vLLM). The
//! stop strings are searched in the tail that could hold one.
use std::sync::Arc;

use crate::model::tokenizer::TextCodec;

/// Text of a growing list of generated ids.
pub struct Detokenizer {
    codec: Arc<TextCodec>,
    ids: Vec<u32>,
    stops: Vec<String>,
    /// The text of `ids[..read]`: whole characters only.
    text: String,
    /// Where the decode window starts (context for `ids[read..]`) and ends.
    prefix: usize,
    read: usize,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// The stop string that appeared, once one did: the text ends before it.
    stopped: Option<String>,
    /// The token after which there is no more text, and whether it came.
    end_of_text: Option<u32>,
    closed: bool,
}

impl Detokenizer {
    pub fn new(codec: Arc<TextCodec>, stops: Vec<String>, end_of_text: Option<u32>) -> Self {
        Detokenizer {
            codec,
            ids: Vec::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            prefix: 0,
            read: 0,
            sent: 0,
            stopped: None,
            end_of_text,
            closed: false,
        }
    }

    /// No more text from here on (a reply generated from inside a tool call has none).
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The stop string that ended the text, if one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Adds a token; returns the text that is now final. After a stop string, nothing.
    pub fn push(&mut self, id: u32) -> String {
        if self.stopped() {
            return String::new();
        }
        self.ids.push(id);
        if self.closed {
            return String::new();
        }
        if Some(id) == self.end_of_text {
            self.closed = true;
            return self.flush(self.ids.len() - 1);
        }
        // A trailing U+FFFD is a character whose bytes are still coming: wait for them.
        let (window, pending) = self.window(self.ids.len());
        if !pending.ends_with('\u{FFFD}') {
            self.text.push_str(&pending[window..]);
            self.prefix = self.read;
            self.read = self.ids.len();
        }
        let search_from = floor_char(&self.text, self.sent.saturating_sub(self.longest_stop()));
        let stop_at = (self.stops.iter())
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| (search_from + i, s))
            })
            .min_by_key(|&(at, _)| at);
        let end = match stop_at {
            Some((at, s)) => {
                self.stopped = Some(s.clone());
                at
            }
            None => floor_char(
                &self.text,
                self.text
                    .len()
                    .saturating_sub(self.longest_stop().saturating_sub(1)),
            ),
        };
        self.take(end)
    }

    /// The text still held back, at the end of the generation.
    pub fn finish(&mut self) -> String {
        if self.stopped() || self.closed {
            return String::new();
        }
        self.flush(self.ids.len())
    }

    /// The decode window over `ids[prefix..end]`: the length of its context part
    /// (`ids[prefix..read]`) and its whole text.
    fn window(&self, end: usize) -> (usize, String) {
        let decode = |ids: &[u32]| self.codec.decode(ids).unwrap_or_default();
        let context = decode(&self.ids[self.prefix..self.read]);
        let all = decode(&self.ids[self.prefix..end]);
        // Decoding more ids never shortens the text before them; if a tokenizer's cleanup
        // rewrote the seam anyway, take its text from where the context's ends.
        (floor_char(&all, context.len()), all)
    }

    /// Everything not yet handed out of the text of the first `end` ids.
    fn flush(&mut self, end: usize) -> String {
        let (window, pending) = self.window(end);
        self.text.push_str(&pending[window..]);
        self.prefix = end;
        self.read = end;
        self.take(self.text.len())
    }

    fn take(&mut self, end: usize) -> String {
        if end <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }

    fn longest_stop(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::default_model::codec;

    fn stream(text: &str, stops: &[&str]) -> (Vec<String>, bool) {
        let c = Arc::new(codec());
        let ids = c.encode(text).unwrap();
        let stops = stops.iter().map(|s| s.to_string()).collect();
        let end = c.token_id("<|tool_calls_section_begin|>");
        let mut d = Detokenizer::new(c.clone(), stops, end);
        let mut parts: Vec<String> = ids.iter().map(|&t| d.push(t)).collect();
        parts.push(d.finish());
        (parts, d.stopped())
    }

    proptest::proptest! {
        /// Any ids, special tokens and lone bytes of multi-byte characters included: the
        /// windowed pieces add up to the text of all ids decoded at once.
        #[test]
        fn windowed_decoding_equals_decoding_everything(
            ids in proptest::collection::vec(0u32..512, 0..120)
        ) {
            let c = Arc::new(codec());
            let whole = c.decode(&ids).unwrap();
            let mut d = Detokenizer::new(c, Vec::new(), None);
            let mut text: String = ids.iter().map(|&t| d.push(t)).collect();
            text.push_str(&d.finish());
            proptest::prop_assert_eq!(text, whole);
        }
    }

    #[test]
    fn the_streamed_pieces_add_up_to_the_whole_text() {
        let text = "kiln serves coding agents: prefix caching, décodé ✓.";
        let (parts, stopped) = stream(text, &[]);
        assert_eq!(parts.concat(), text);
        assert!(!stopped);
    }

    #[test]
    fn text_held_back_for_a_stop_string_is_released_at_the_end_of_text() {
        let (parts, stopped) = stream(
            "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.ls:0\n",
            &["</answer>", "\n"],
        );
        assert_eq!(
            parts.concat(),
            "Let me check.",
            "nothing after the section is text"
        );
        assert!(!stopped, "the newline in the call is not matched as a stop");
    }

    #[test]
    fn text_ends_before_the_first_stop_string_and_none_of_it_is_streamed() {
        let (parts, stopped) = stream("first line\nsecond STOP third", &["STOP", "third"]);
        assert_eq!(parts.concat(), "first line\nsecond ");
        assert!(stopped);
        assert!(parts.iter().all(|p| !p.contains('S')), "{parts:?}");
    }
}
