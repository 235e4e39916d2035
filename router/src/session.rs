//! Session keys: which requests belong to one agent session and should share a replica.
//!
//! The key is the session header when the client sends one (`x-session-id`, or a coding
//! agent's own: `kiln_core::session::SESSION_HEADERS`). Otherwise it is a
//! hash of the start of the conversation, which every later turn of the same session
//! re-sends unchanged: for chat requests the messages up to and including the first
//! `user` message (the system prompt alone is shared by every session of one agent, so
//! it is not enough); for completions the first [`PROMPT_PREFIX_BYTES`] of the prompt;
//! for SGLang `/generate` the first [`PREFIX_TOKENS`] input ids. A request with neither
//! (a `GET /v1/models`, a body that is not JSON) has no key and is placed by load alone.

use crate::hashing::hash_bytes;
use serde_json::Value;

/// Bytes of a completion prompt hashed when there is no session header.
pub const PROMPT_PREFIX_BYTES: usize = 4096;

/// Input ids of a `/generate` request hashed when there is no session header.
pub const PREFIX_TOKENS: usize = 1024;

/// A session's identity: a stable 64-bit hash (equal keys mean one session).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(pub u64);

/// The session key of a request from its session header's value and its body.
pub fn session_key(header: Option<&str>, body: &[u8]) -> Option<SessionKey> {
    if let Some(id) = header.map(str::trim).filter(|id| !id.is_empty()) {
        return Some(SessionKey(hash_bytes(format!("header:{id}").as_bytes())));
    }
    let json: Value = serde_json::from_slice(body).ok()?;
    let prefix = conversation_prefix(&json)?;
    Some(SessionKey(hash_bytes(format!("body:{prefix}").as_bytes())))
}

/// The canonical text of the part of a request every turn of its session repeats.
fn conversation_prefix(json: &Value) -> Option<String> {
    if let Some(messages) = json.get("messages").and_then(Value::as_array) {
        let end = messages
            .iter()
            .position(|m| m.get("role").and_then(Value::as_str) == Some("user"))?;
        // serde_json's maps are sorted, so key order in the client's JSON does not matter.
        return serde_json::to_string(&messages[..=end]).ok();
    }
    if let Some(prompt) = json.get("prompt").and_then(Value::as_str) {
        let mut end = prompt.len().min(PROMPT_PREFIX_BYTES);
        while !prompt.is_char_boundary(end) {
            end -= 1;
        }
        return Some(prompt[..end].to_string());
    }
    let ids = json.get("input_ids").and_then(Value::as_array)?;
    serde_json::to_string(&ids[..ids.len().min(PREFIX_TOKENS)]).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(turns: &[(&str, &str)]) -> Vec<u8> {
        let messages: Vec<Value> = turns
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
    }

    #[test]
    fn the_session_header_wins_over_the_body() {
        let a = session_key(Some("abc"), &chat(&[("user", "x")]));
        let b = session_key(Some("abc"), &chat(&[("user", "y")]));
        assert_eq!(a, b);
        assert_ne!(a, session_key(Some("abd"), &chat(&[("user", "x")])));
    }

    #[test]
    fn later_turns_of_a_headerless_chat_keep_the_first_turns_key() {
        let first = chat(&[("system", "agent"), ("user", "fix the bug")]);
        let later = chat(&[
            ("system", "agent"),
            ("user", "fix the bug"),
            ("assistant", "done"),
            ("user", "now test it"),
        ]);
        assert_eq!(session_key(None, &first), session_key(None, &later));
    }

    #[test]
    fn sessions_sharing_a_system_prompt_get_different_keys() {
        let a = chat(&[("system", "agent"), ("user", "task a")]);
        let b = chat(&[("system", "agent"), ("user", "task b")]);
        assert_ne!(session_key(None, &a), session_key(None, &b));
    }

    #[test]
    fn a_blank_header_falls_back_to_the_body() {
        let body = chat(&[("user", "x")]);
        assert_eq!(session_key(Some("  "), &body), session_key(None, &body));
    }

    #[test]
    fn generate_requests_are_keyed_by_their_leading_input_ids() {
        let long: Vec<u32> = (0..3000).collect();
        let longer: Vec<u32> = (0..5000).collect();
        let a = serde_json::to_vec(&serde_json::json!({"input_ids": long})).unwrap();
        let b = serde_json::to_vec(&serde_json::json!({"input_ids": longer})).unwrap();
        assert!(session_key(None, &a).is_some());
        assert_eq!(session_key(None, &a), session_key(None, &b));
    }

    #[test]
    fn completion_prompts_are_cut_on_a_character_boundary() {
        let prompt = "é".repeat(PROMPT_PREFIX_BYTES);
        let body = serde_json::to_vec(&serde_json::json!({"prompt": prompt})).unwrap();
        assert!(session_key(None, &body).is_some());
    }

    #[test]
    fn requests_without_a_conversation_have_no_key() {
        assert_eq!(session_key(None, b""), None);
        assert_eq!(session_key(None, b"{\"model\":\"m\"}"), None);
        assert_eq!(session_key(None, &chat(&[("system", "only")])), None);
    }
}
