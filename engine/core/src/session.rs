//! Which request headers name an agent session: kiln's own, and those coding agents send
//! unasked (Claude Code's, Codex's). The server logs the session; the router keeps a
//! session on the replica that holds its cache.

/// Session headers in the order they are read: the first non-empty one names the session.
pub const SESSION_HEADERS: [&str; 3] = ["x-session-id", "x-claude-code-session-id", "session_id"];

/// The session a request names, from a lookup of its headers by name.
pub fn session_of<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Option<&'a str> {
    SESSION_HEADERS
        .iter()
        .filter_map(|name| header(name))
        .map(str::trim)
        .find(|id| !id.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kilns_header_comes_first_then_the_agents_own() {
        let headers = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
        };
        assert_eq!(
            session_of(headers(&[("session_id", "codex-1")])),
            Some("codex-1")
        );
        assert_eq!(
            session_of(headers(&[
                ("x-claude-code-session-id", " cc-2 "),
                ("session_id", "x")
            ])),
            Some("cc-2")
        );
        assert_eq!(
            session_of(headers(&[("x-session-id", ""), ("session_id", "codex-3")])),
            Some("codex-3")
        );
        assert_eq!(
            session_of(headers(&[("session_id", "b"), ("x-session-id", "a")])),
            Some("a")
        );
        assert_eq!(session_of(headers(&[("x-request-id", "r")])), None);
    }
}
