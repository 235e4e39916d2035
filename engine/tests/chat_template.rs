//! Chat templates render as transformers renders them: kiln's minijinja rendering against
//! transformers' own `render_jinja_template` (tools/render_chat_template.py; transformers
//! and jinja2 are installed by .ci/setup), for Kimi's template and templates in other
//! models' styles, over conversations with tools, tool calls and results.
use std::io::Write;
use std::process::{Command, Stdio};

use kiln::model::default_model;
use kiln::server::{ChatMessage, ChatTemplate, KIMI_TEMPLATE};
use serde_json::{json, Value};

/// A DeepSeek-V3-like format (written for this test): system prompts gathered in a
/// namespace, tools as indented JSON, tool calls in fenced blocks, loop controls.
const DEEPSEEK_STYLE: &str = r#"
{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' -%}
  {%- set ns.system = ns.system + m.content.strip() + '\n' -%}
{%- endfor -%}
{{ bos_token }}{{ ns.system }}
{%- if tools %}
## Tools
{% for tool in tools %}
### {{ tool.function.name }}
{{ tool.function | tojson(indent=2) }}
{% endfor %}
{%- endif %}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}{%- continue -%}{%- endif -%}
  {%- if m.role == 'user' -%}<｜User｜>{{ m.content }}
  {%- elif m.role == 'assistant' -%}<｜Assistant｜>{{ m.content | trim }}
    {%- if m.tool_calls is defined -%}
      {%- for call in m.tool_calls -%}
<｜tool▁call▁begin｜>{{ call.type }}<｜tool▁sep｜>{{ call.function.name }}
```json
{{ call.function.arguments }}
```<｜tool▁call▁end｜>
      {%- endfor -%}
    {%- endif -%}
{{ eos_token }}
  {%- elif m.role == 'tool' -%}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}
"#;

/// Python's string and dict methods and Jinja filters that HF templates call.
const PYTHON_METHODS: &str = r#"
{%- for m in messages -%}
{{ loop.index }}. {{ m.role.upper() }}{% if m.content.startswith(' ') %} (indented){% endif %}: {{ m.content.split('\n') | length }} line(s), {{ m.content.replace('a', 'A') | trim }}
{% for k, v in m.items() %}{{ k }}={{ v | tojson }};{% endfor %}
{% if m.tool_call_id is defined and m.tool_call_id.endswith(':0') %}first call{% endif %}
{%- endfor %}
{% if tools %}{% for t in tools %}{{ t.function.get('description', 'no description') }} | {{ t.function.parameters.properties | list | join(',') }} | {{ t | tojson(separators=(',', ':'), sort_keys=True) }}
{% endfor %}{% endif -%}
"#;

fn conversations() -> Vec<(Vec<Value>, Option<Value>)> {
    let tools = json!([{"type": "function", "function": {"name": "read_file",
        "description": "Read a file.", "parameters": {"type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
        "required": ["path"]}}},
        {"type": "function", "function": {"name": "run", "parameters": {"type": "object",
        "properties": {"cmd": {"type": "string", "description": "a shell line: ünïcode \"quoted\""}}}}}]);
    vec![
        (vec![json!({"role": "user", "content": "Hi"})], None),
        (
            vec![
                json!({"role": "system", "content": "  Be brief.\n"}),
                json!({"role": "user", "content": "Reverse a list\n\nin Python."}),
                json!({"role": "assistant", "content": " def rev(xs):\n    return xs[::-1] "}),
                json!({"role": "user", "content": " and a tuple?"}),
            ],
            None,
        ),
        (
            vec![
                json!({"role": "system", "content": "You are a coding agent."}),
                json!({"role": "user", "content": "What does `dumps` in json/__init__.py do?"}),
                json!({"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "functions.read_file:0", "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\": \"json/__init__.py\"}"}}]}),
                json!({"role": "tool", "content": "def dumps(obj, *, skipkeys=False):\n    ...",
                       "tool_call_id": "functions.read_file:0"}),
                json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "functions.run:1", "type": "function",
                     "function": {"name": "run", "arguments": "{\"cmd\": \"ls -a\"}"}}]}),
                json!({"role": "tool", "content": "a.py\tb.py", "tool_call_id": "functions.run:1"}),
            ],
            Some(tools.clone()),
        ),
        (
            vec![json!({"role": "user", "content": "Schreib 'café' ✓ — a\ttab"})],
            Some(tools),
        ),
    ]
}

/// What transformers renders for each conversation.
fn transformers_renders(template: &str, bos: &str, eos: &str) -> Vec<String> {
    let cases: Vec<Value> = (conversations().into_iter())
        .map(|(messages, tools)| json!({"messages": messages, "tools": tools}))
        .collect();
    let job = json!({"template": template, "bos_token": bos, "eos_token": eos, "cases": cases});
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tools/render_chat_template.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(job.to_string().as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{script} failed (transformers and jinja2 come from .ci/setup):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("a JSON list of strings")
}

fn kiln_renders(template: &str, bos: &str, eos: &str) -> Vec<String> {
    let mut codec = default_model::codec();
    codec.bos_token = Some(bos.into());
    codec.eos_token = Some(eos.into());
    let t = ChatTemplate::new(template, &codec).expect("the template compiles");
    (conversations().into_iter())
        .map(|(messages, tools)| {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(Value::Array(messages)).unwrap();
            t.render(&messages, tools.as_ref())
                .expect("the template renders")
        })
        .collect()
}

fn check(template: &str, bos: &str, eos: &str) {
    let (kiln, hf) = (
        kiln_renders(template, bos, eos),
        transformers_renders(template, bos, eos),
    );
    for (i, (k, h)) in kiln.iter().zip(&hf).enumerate() {
        assert_eq!(
            k, h,
            "conversation {i}: kiln's rendering (left) is not transformers' (right)"
        );
    }
    assert_eq!(kiln.len(), hf.len());
}

#[test]
fn kimis_template_renders_as_in_transformers() {
    check(KIMI_TEMPLATE, "[BOS]", "<|im_end|>");
}

#[test]
fn a_deepseek_style_template_renders_as_in_transformers() {
    check(
        DEEPSEEK_STYLE,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    );
}

#[test]
fn pythons_string_and_dict_methods_render_as_in_transformers() {
    check(PYTHON_METHODS, "", "");
}
