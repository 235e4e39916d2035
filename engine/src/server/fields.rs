//! Request fields kiln does not act on. Each is either harmless to ignore (metadata), or
//! accepted only at the value that turns it off (a penalty of 0); anything else, and any
//! field kiln does not know, is a 400 naming it, so a client never gets an answer to a
//! request it did not make.
use serde_json::{Map, Value};

use super::error::ApiError;

/// Fields that change nothing about the output.
const IGNORED: &[&str] = &["user", "metadata", "store", "service_tier", "rid"];

/// A field and the test of the value that leaves it off.
pub(super) type Neutral = (&'static str, fn(&Value) -> bool);

fn zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

fn one(v: &Value) -> bool {
    v.as_f64() == Some(1.0)
}

fn no(v: &Value) -> bool {
    v == &Value::Bool(false)
}

fn yes(v: &Value) -> bool {
    v == &Value::Bool(true)
}

fn empty(v: &Value) -> bool {
    v.as_object().is_some_and(Map::is_empty) || v.as_str() == Some("")
}

/// Sampling penalties and filters both APIs know, off.
pub(super) const PENALTIES: &[Neutral] = &[
    ("frequency_penalty", zero),
    ("presence_penalty", zero),
    ("repetition_penalty", one),
];

/// OpenAI's and vLLM's request fields, off.
pub const OPENAI: &[&[Neutral]] = &[
    PENALTIES,
    &[
        ("logit_bias", empty),
        ("echo", no),
        ("best_of", one),
        ("suffix", empty),
        ("parallel_tool_calls", yes),
    ],
];

/// SGLang's `sampling_params` fields, off.
pub const SGLANG_SAMPLING: &[&[Neutral]] = &[
    PENALTIES,
    &[("min_new_tokens", zero), ("skip_special_tokens", yes)],
];

/// Checks the fields a request's known ones left over (`rest`, a `serde(flatten)` map)
/// against the `neutral` lists; `prefix` names where they sit (`sampling_params.`).
pub fn refuse_unsupported(
    rest: &Map<String, Value>,
    prefix: &str,
    neutral: &[&[Neutral]],
) -> Result<(), ApiError> {
    for (name, value) in rest {
        let field = format!("{prefix}{name}");
        if value.is_null() || IGNORED.contains(&name.as_str()) {
            continue;
        }
        match neutral
            .iter()
            .flat_map(|l| l.iter())
            .find(|(n, _)| n == name)
        {
            Some((_, off)) if off(value) => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    &field,
                    format!("kiln does not support {value} here yet; leave it out"),
                ))
            }
            None => return Err(ApiError::unsupported(&field, "unknown field")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(v: Value) -> Result<(), String> {
        let rest = v.as_object().unwrap().clone();
        refuse_unsupported(&rest, "", OPENAI).map_err(|e| e.param.unwrap())
    }

    #[test]
    fn fields_left_off_pass_and_the_rest_are_named() {
        assert_eq!(
            check(
                json!({"user": "u", "frequency_penalty": 0, "logit_bias": {},
                         "presence_penalty": null})
            ),
            Ok(())
        );
        assert_eq!(
            check(json!({"frequency_penalty": 0.5})),
            Err("frequency_penalty".into())
        );
        assert_eq!(
            check(json!({"repetition_penalty": 1.1})),
            Err("repetition_penalty".into())
        );
        assert_eq!(
            check(json!({"logit_bias": {"5": 10}})),
            Err("logit_bias".into())
        );
        assert_eq!(check(json!({"temprature": 0.2})), Err("temprature".into()));
        let rest = json!({"presence_penalty": 0.3})
            .as_object()
            .unwrap()
            .clone();
        let e = refuse_unsupported(&rest, "sampling_params.", SGLANG_SAMPLING).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.presence_penalty"));
    }
}
