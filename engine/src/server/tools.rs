//! What a chat request says about tools: its declarations checked (OpenAI's shape:
//! `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`) and its
//! `tool_choice` resolved. Tool calls are parsed out of a reply only when tools were
//! offered; then only calls of declared tools come back, with ids in Kimi's
//! `functions.NAME:IDX` form. Without tools the model's tool-call marker ends its turn.
use std::collections::HashSet;

use serde_json::Value;

use super::chat_format::ToolCall;
use super::error::ApiError;

/// Tools a request offers the model.
pub struct Tools {
    /// The declarations as the prompt shows them.
    pub declared: Value,
    names: HashSet<String>,
    /// A call the reply must make (`tool_choice` `"required"` or a named function).
    pub forced: Option<Forced>,
}

/// A tool call the reply is made to start with: the reply is generated from inside the
/// tool-call section (a call of any tool), or from inside the named tool's call (its
/// arguments); the rest of the section is constrained to calls of declared tools whose
/// arguments match their schemas (`grammar::Grammars::forced_calls`).
#[derive(Clone, Debug, PartialEq)]
pub enum Forced {
    Any,
    Named(String),
}

fn bad(param: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(format!("{param}: {why}"), Some(param))
}

/// OpenAI's rule for function names: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The declared tool names, or a 400 naming the first bad field.
fn declarations(tools: &Value) -> Result<HashSet<String>, ApiError> {
    let list = tools
        .as_array()
        .ok_or_else(|| bad("tools", "must be an array of tool declarations"))?;
    let mut names = HashSet::new();
    for (i, tool) in list.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(&at(".type"), "must be \"function\""));
        }
        let function = tool
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| bad(&at(".function"), "must be an object"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&at(".function.name"), "must be a string"))?;
        if !valid_name(name) {
            return Err(bad(
                &at(".function.name"),
                format!("`{name}` is not 1 to 64 letters, digits, `_` or `-`"),
            ));
        }
        match function.get("parameters") {
            None | Some(Value::Null) | Some(Value::Object(_)) => {}
            Some(_) => {
                return Err(bad(
                    &at(".function.parameters"),
                    "must be a JSON Schema object",
                ))
            }
        }
        if function
            .get("description")
            .is_some_and(|d| !d.is_string() && !d.is_null())
        {
            return Err(bad(&at(".function.description"), "must be a string"));
        }
        if !names.insert(name.to_string()) {
            return Err(bad(
                &at(".function.name"),
                format!("`{name}` is declared twice"),
            ));
        }
    }
    Ok(names)
}

/// The tools a request offers: `None` when it declares none or `tool_choice` is `"none"`;
/// `"required"` and a named function force a call ([`Forced`]; `"required"` with one tool
/// declared names it). Impossible choices are 400s naming `tool_choice`.
pub fn resolve(tools: Option<&Value>, choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
    let tools = tools.filter(|t| !t.is_null());
    let names = tools.map(declarations).transpose()?.unwrap_or_default();
    let mut forced = None;
    match choice.filter(|c| !c.is_null()) {
        None => {}
        Some(Value::String(s)) if s == "none" => return Ok(None),
        Some(Value::String(s)) if s == "auto" => {}
        Some(Value::String(s)) if s == "required" => {
            if names.is_empty() {
                return Err(bad("tool_choice", "\"required\" but no tools are declared"));
            }
            forced = Some(match names.len() {
                1 => Forced::Named(names.iter().next().expect("one").clone()),
                _ => Forced::Any,
            });
        }
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
                })?;
            if !names.contains(name) {
                return Err(bad(
                    "tool_choice",
                    format!("names `{name}`, which is not among the declared tools"),
                ));
            }
            forced = Some(Forced::Named(name.to_string()));
        }
        Some(other) => {
            return Err(bad(
                "tool_choice",
                format!("{other} is not \"none\", \"auto\", \"required\" or a function"),
            ))
        }
    }
    Ok((!names.is_empty()).then(|| Tools {
        declared: tools.cloned().unwrap_or(Value::Null),
        names,
        forced,
    }))
}

impl Tools {
    /// The calls of declared tools among `calls`, ids in Kimi's `functions.NAME:IDX` form
    /// (a malformed id is rebuilt from the name and the call's place).
    pub fn accept(&self, calls: Vec<ToolCall>) -> Vec<ToolCall> {
        let mut kept = Vec::new();
        for mut c in calls {
            if let Some(id) = self.accept_one(&c.id, &c.function.name, kept.len()) {
                c.id = id;
                kept.push(c);
            }
        }
        kept
    }

    /// The id a call of `name` with id `id` is reported under as the `index`-th kept
    /// call, or `None` if `name` was not declared.
    pub fn accept_one(&self, id: &str, name: &str, index: usize) -> Option<String> {
        if !self.names.contains(name) {
            return None;
        }
        Some(match kimi_id(id, name) {
            true => id.to_string(),
            false => format!("functions.{name}:{index}"),
        })
    }
}

/// Whether `id` is `functions.NAME:IDX` with a decimal `IDX`.
fn kimi_id(id: &str, name: &str) -> bool {
    id.strip_prefix("functions.")
        .and_then(|rest| rest.strip_prefix(name))
        .and_then(|rest| rest.strip_prefix(':'))
        .is_some_and(|idx| {
            !idx.is_empty() && idx.len() <= 6 && idx.bytes().all(|b| b.is_ascii_digit())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(name: &str) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    }

    fn param(r: Result<Option<Tools>, ApiError>) -> String {
        r.err().and_then(|e| e.param).unwrap_or_default()
    }

    #[test]
    fn declarations_are_checked_field_by_field() {
        let cases = [
            (json!({"a": 1}), "tools"),
            (json!([{"type": "retrieval"}]), "tools[0].type"),
            (
                json!([tool("ls"), {"type": "function"}]),
                "tools[1].function",
            ),
            (
                json!([{"type": "function", "function": {"name": 3}}]),
                "tools[0].function.name",
            ),
            (json!([tool("has space")]), "tools[0].function.name"),
            (json!([tool("ls"), tool("ls")]), "tools[1].function.name"),
            (
                json!([{"type": "function", "function": {"name": "ls", "parameters": "x"}}]),
                "tools[0].function.parameters",
            ),
        ];
        for (tools, at) in cases {
            assert_eq!(param(resolve(Some(&tools), None)), at, "{tools}");
        }
        assert!(resolve(Some(&json!([tool("ls"), tool("read_file")])), None)
            .unwrap()
            .is_some());
    }

    #[test]
    fn tool_choice_offers_tools_and_forces_a_call_when_asked() {
        let tools = json!([tool("ls")]);
        assert!(
            resolve(None, None).unwrap().is_none(),
            "no tools, no parsing"
        );
        assert!(resolve(Some(&json!([])), Some(&json!("auto")))
            .unwrap()
            .is_none());
        assert!(resolve(Some(&tools), Some(&json!("none")))
            .unwrap()
            .is_none());
        let forced = |tools: &Value, choice: Value| {
            resolve(Some(tools), Some(&choice)).unwrap().unwrap().forced
        };
        assert_eq!(forced(&tools, json!("auto")), None);
        let named = json!({"type": "function", "function": {"name": "ls"}});
        assert_eq!(forced(&tools, named), Some(Forced::Named("ls".into())));
        // "required" with one tool is that tool; with several, any of them.
        assert_eq!(
            forced(&tools, json!("required")),
            Some(Forced::Named("ls".into()))
        );
        let two = json!([tool("ls"), tool("cat")]);
        assert_eq!(forced(&two, json!("required")), Some(Forced::Any));
        for choice in [
            json!("bogus"),
            json!(7),
            json!({"type": "function", "function": {"name": "rm"}}),
        ] {
            assert_eq!(
                param(resolve(Some(&tools), Some(&choice))),
                "tool_choice",
                "{choice}"
            );
        }
        let e = resolve(None, Some(&json!("required"))).err().unwrap();
        assert!(e.message.contains("no tools"), "{}", e.message);
    }

    #[test]
    fn only_declared_tools_come_back_with_kimi_ids() {
        let tools = resolve(Some(&json!([tool("ls")])), None).unwrap().unwrap();
        let call = |id: &str, name: &str| ToolCall {
            id: id.into(),
            kind: "function".into(),
            function: super::super::chat_format::FunctionCall {
                name: name.into(),
                arguments: "{}".into(),
            },
        };
        let kept = tools.accept(vec![
            call("functions.rm:0", "rm"),
            call(&"x".repeat(1000), "ls"),
            call("functions.ls:7", "ls"),
        ]);
        let ids: Vec<&str> = kept.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["functions.ls:0", "functions.ls:7"]);
    }
}
