//! HF's `tojson` filter for chat templates: what Python's `json.dumps` writes, with its
//! `indent`, `separators`, `sort_keys` and `ensure_ascii` keywords (Jinja's own `tojson`
//! escapes HTML characters, which transformers replaces for templates).
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// HF's `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keywords settable (not Jinja's default,
/// which escapes HTML characters).
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.kind() == ValueKind::None => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_string()),
        Some(v) => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item, key) = match separators.filter(|v| v.kind() != ValueKind::None) {
        Some(v) => {
            let parts: Vec<String> = v.try_iter()?.map(|p| p.to_string()).collect();
            match parts.as_slice() {
                [i, k] => (i.clone(), k.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be (item, key)",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    style.write(&mut out, value, 0)?;
    Ok(Value::from(out))
}

/// How `json.dumps` was asked to write.
struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
    ascii: bool,
}

impl JsonStyle {
    fn write(&self, out: &mut String, v: &Value, depth: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float(f));
            }
            ValueKind::String => self.string(out, v.as_str().unwrap_or("")),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container(out, '[', ']', depth, items.len(), |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.container(out, '{', '}', depth, keys.len(), |out, i| {
                    self.string(out, &keys[i].to_string());
                    out.push_str(&self.key);
                    self.write(out, &v.get_item(&keys[i])?, depth + 1)
                })?;
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {} is not JSON", v.kind()),
                ))
            }
        }
        Ok(())
    }

    fn container(
        &self,
        out: &mut String,
        open: char,
        close: char,
        depth: usize,
        len: usize,
        mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        let newline = |out: &mut String, d: usize| {
            if let Some(ind) = &self.indent {
                out.push('\n');
                out.push_str(&ind.repeat(d));
            }
        };
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            item(out, i)?;
        }
        newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A float as Python's `repr` writes it (shortest round trip; exponent from 1e16 and below
/// 1e-4).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').expect("{:e} has an exponent");
        let exp: i32 = exp.parse().expect("an integer exponent");
        return format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        );
    }
    format!("{f:?}")
}
