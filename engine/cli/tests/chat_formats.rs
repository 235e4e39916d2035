//! Chat formats end to end: a checkpoint's own chat template shaping the prompt, and a
//! thinking model's reasoning split from its answer on every API (chat's
//! `reasoning_content`, Messages' thinking blocks, Responses' reasoning items), read by
//! the official clients where they exist. The thinking model is scripted
//! ([`thinking_model`]).
mod common;

use std::path::Path;

use common::server::Server;
use common::{post, post_text, run_python_client};
use serde_json::{json, Value};

/// A checkpoint's own `chat_template` (tokenizer_config.json) shapes the prompt: its text
/// with its special tokens as tokens, and special-token strings a user types as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoints_chat_template_renders_the_prompt() {
    let dir = tempfile::tempdir().unwrap();
    kiln::model::default_model::write(dir.path()).unwrap();
    let template = "{{ bos_token }}{% for m in messages %}### {{ m.role | upper }}\n\
                    {{ m.content.strip() }}{{ eos_token }}{% endfor %}\
                    {% if add_generation_prompt %}### ASSISTANT\n{% endif %}";
    let config =
        json!({"chat_template": template, "bos_token": "[BOS]", "eos_token": "<|im_end|>"});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let server = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let body = json!({"messages": [{"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "say <|im_end|> twice"}],
        "max_tokens": 2, "temperature": 0, "return_token_ids": true});
    let url = format!("{}/v1/chat/completions", server.url);
    let (status, reply) = post(&url, body.to_string(), None).await;
    assert_eq!(status, 200, "{reply}");
    let ids: Vec<u32> = serde_json::from_value(reply["prompt_token_ids"].clone()).unwrap();
    let codec = kiln::model::default_model::codec();
    assert_eq!(
        codec.decode_with_special(&ids).unwrap(),
        "[BOS]### SYSTEM\nBe brief.<|im_end|>### USER\nsay <|im_end|> twice<|im_end|>### ASSISTANT\n"
    );
    let end = codec.token_id("<|im_end|>").unwrap();
    assert_eq!(
        ids.iter().filter(|&&t| t == end).count(),
        2,
        "the user's <|im_end|> stays text: {ids:?}"
    );
}

/// A thinking model's reply: what it writes between `<think>` and `</think>` comes back as
/// `reasoning_content`, whole and streamed, and the rest as `content`; with
/// `separate_reasoning: false` all of it is content (the scripted
/// [`thinking_model`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thinking_models_reasoning_comes_apart_from_its_answer() {
    let dir = tempfile::tempdir().unwrap();
    let server = thinker(dir.path());
    let url = format!("{}/v1/chat/completions", server.url);
    let ask = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                     "temperature": 0});

    let (status, reply) = post(&url, ask.to_string(), None).await;
    assert_eq!(status, 200, "{reply}");
    let message = &reply["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Hm", "{reply}");
    assert_eq!(message["content"], "!", "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 4, "{reply}"); // H m </think> !
    let details = &reply["usage"]["completion_tokens_details"];
    assert_eq!(details["reasoning_tokens"], 3, "{reply}"); // H m </think>

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let text = post_text(&url, &streamed).await;
    let (mut reasoning, mut content) = (String::new(), String::new());
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or(""));
        content.push_str(delta["content"].as_str().unwrap_or(""));
    }
    assert_eq!(
        (reasoning.as_str(), content.as_str()),
        ("Hm", "!"),
        "{text}"
    );

    let mut together = ask.clone();
    together["separate_reasoning"] = json!(false);
    let (status, reply) = post(&url, together.to_string(), None).await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "Hm!", "{reply}");
    assert!(
        reply["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{reply}"
    );
}

/// A thinking model's reasoning is a thinking block (whole and streamed) when the request
/// enables thinking, and left out of the text when it does not; thinking blocks sent back
/// reach the template. Read by Anthropic's Python client on the scripted
/// [`thinking_model`] (reasoning "Hm", answer "!").
#[test]
fn a_thinking_models_reasoning_is_a_thinking_block() {
    let dir = tempfile::tempdir().unwrap();
    let server = thinker(dir.path());
    let script = r#"
import sys, anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0)
ask = dict(model="thinker", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
on = dict(thinking={"type": "enabled", "budget_tokens": 1024}, **ask)
m = c.messages.create(**on)
assert [b.type for b in m.content] == ["thinking", "text"], m.content
assert (m.content[0].thinking, m.content[1].text) == ("Hm", "!"), m.content
with c.messages.stream(**on) as s:
    final = s.get_final_message()
assert [b.type for b in final.content] == ["thinking", "text"], final.content
assert (final.content[0].thinking, final.content[1].text) == ("Hm", "!"), final.content
off = c.messages.create(**ask)
assert [(b.type, b.text) for b in off.content] == [("text", "!")], off.content
again = c.messages.create(**dict(on, messages=[{"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm", "signature": ""},
                                      {"type": "text", "text": "!"}]},
    {"role": "user", "content": "more"}]))
assert again.content[0].type == "thinking", again.content
print("ok")
"#;
    run_python_client(script, &server.url, "anthropic", "anthropic==2.17.0");
}

/// A thinking model's reasoning is a `reasoning` item, whole and streamed, kept out of the
/// output text; reasoning items sent back are accepted. OpenAI's client on the scripted
/// [`thinking_model`] (reasoning "Hm", answer "!").
#[test]
fn a_thinking_models_reasoning_is_a_reasoning_item() {
    let dir = tempfile::tempdir().unwrap();
    let server = thinker(dir.path());
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
ask = dict(model="thinker", input="hi", max_output_tokens=16, reasoning={"effort": "low"})
r = c.responses.create(**ask)
assert [o.type for o in r.output] == ["reasoning", "message"], r.output
assert r.output[0].content[0].text == "Hm" and r.output_text == "!", r
assert r.usage.output_tokens_details.reasoning_tokens == 3, r.usage
events = list(c.responses.create(stream=True, **ask))
final = events[-1].response
assert sorted(o.type for o in final.output) == ["message", "reasoning"], final.output
assert final.output_text == "!", final
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
assert deltas == "!", deltas
back = c.responses.create(**dict(ask, input=[{"role": "user", "content": "hi"},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "Hm"}]},
    {"role": "assistant", "content": "!"}, {"role": "user", "content": "more"}]))
assert back.output_text == "!", back
print("ok")
"#;
    run_python_client(script, &server.url, "openai", "openai==3.63.0");
}

/// A scripted thinking model in `dir`: the tiny model with two special tokens respelled as
/// `<think>` and `</think>`, a template whose generation prompt opens the reasoning, and
/// weights that then write `H` `m` `</think>` `!` and end: its reasoning is "Hm", its
/// answer "!".
fn thinking_model(dir: &Path) {
    let codec = kiln::model::default_model::codec();
    let one = |s: &str| -> usize {
        let ids = codec.encode(s).unwrap();
        assert_eq!(ids.len(), 1, "{s} is one token");
        ids[0] as usize
    };
    let (open, close, eos) = (12, 3, 1); // [PAD] and <|im_user|> respelled; [EOS]
    let (a, b, c) = (one("H"), one("m"), one("!"));
    let script = [(open, a), (a, b), (b, close), (close, c)];
    let classes: std::collections::HashSet<usize> = script.iter().map(|(t, _)| t % 128).collect();
    assert_eq!(classes.len(), script.len(), "distinct embedding dimensions");
    common::scripted_model(dir, |d| {
        (script.iter().find(|(t, _)| t % 128 == d)).map_or(eos, |&(_, n)| n)
    });
    let tokenizer = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let tokenizer = tokenizer
        .replace("\"[PAD]\"", "\"<think>\"")
        .replace("\"<|im_user|>\"", "\"</think>\"");
    std::fs::write(dir.join("tokenizer.json"), tokenizer).unwrap();
    let template = "{% for m in messages %}{{ m.content }}{% endfor %}<think>";
    let config = json!({"chat_template": template, "eos_token": "[EOS]"});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// `kiln serve` of the thinking model in `dir`, served as `thinker`.
fn thinker(dir: &Path) -> Server {
    thinking_model(dir);
    Server::start(&[
        "--model",
        dir.to_str().unwrap(),
        "--served-model-name",
        "thinker",
    ])
}
