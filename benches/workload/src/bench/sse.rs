//! Server-sent events framing for streamed responses: bytes in, `data:` payloads out.
//!
//! Follows the WHATWG event-stream format as OpenAI-compatible servers use it: events
//! end with a blank line, each `data:` line contributes one line of the payload (joined
//! with `\n`), other fields (`event:`, `id:`, comments starting with `:`) are ignored,
//! and lines may end in `\n` or `\r\n`. Chunks from the network may split anywhere,
//! including inside a UTF-8 character, so bytes are buffered until a line is whole.

/// Incremental SSE parser.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Vec<String>,
}

impl SseParser {
    /// Feeds a chunk; returns the payloads of the events it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.data.is_empty() {
                    events.push(self.data.join("\n"));
                    self.data.clear();
                }
            } else if let Some(rest) = line.strip_prefix("data:") {
                self.data
                    .push(rest.strip_prefix(' ').unwrap_or(rest).to_string());
            }
        }
        events
    }

    /// The payload of an event the stream ended without terminating, if any.
    pub fn finish(&mut self) -> Option<String> {
        let tail = std::mem::take(&mut self.buf);
        let tail = String::from_utf8_lossy(&tail);
        if let Some(rest) = tail.trim_end_matches(['\n', '\r']).strip_prefix("data:") {
            self.data.push(rest.trim_start().to_string());
        }
        (!self.data.is_empty()).then(|| std::mem::take(&mut self.data).join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(
            p.push(b"1}\n\ndata: [DONE]\n\n"),
            vec!["{\"a\":1}", "[DONE]"]
        );
    }

    #[test]
    fn crlf_comments_and_other_fields_are_handled() {
        let mut p = SseParser::default();
        let got =
            p.push(b": keep-alive\r\n\r\nevent: message\r\nid: 3\r\ndata: x\r\ndata: y\r\n\r\n");
        assert_eq!(got, vec!["x\ny"]);
    }

    #[test]
    fn a_multibyte_character_split_between_chunks_survives() {
        let mut p = SseParser::default();
        let bytes = "data: é\n\n".as_bytes();
        assert!(p.push(&bytes[..7]).is_empty());
        assert_eq!(p.push(&bytes[7..]), vec!["é"]);
    }

    #[test]
    fn an_unterminated_last_event_is_returned_at_the_end() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: last").is_empty());
        assert_eq!(p.finish().as_deref(), Some("last"));
        assert_eq!(p.finish(), None);
    }
}
