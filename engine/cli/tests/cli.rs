//! The `kiln` binary as a user meets it: help text, clear errors for bad choices, and
//! `kiln generate` on a real (tiny) model directory, checked against the reference model.
use std::path::Path;
use std::process::Command;

use kiln::model::Checkpoint;
use kiln_reference::model::{forward_with_kv, KvStorage};

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

#[test]
fn help_lists_the_subcommands() {
    let out = kiln(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for sub in ["check", "generate", "info"] {
        assert!(text.contains(sub), "--help does not mention {sub}:\n{text}");
    }
}

#[test]
fn an_unknown_backend_is_named_in_the_error() {
    let out = kiln(&["info", "--backend", "metal"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend \"metal\""));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_backend_not_compiled_in_says_how_to_get_it() {
    let out = kiln(&["check", "--backend", "cuda"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--features cuda"));
}

fn ids_after(label: &str, stdout: &str) -> Vec<u32> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no {label} in {stdout}"));
    line[label.len()..]
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect()
}

/// Greedy generation on the tiny Kimi-shaped fixture equals the reference model's greedy
/// continuation (bf16 KV on both sides), for as long as the reference's top choice is clear.
#[test]
fn generate_continues_the_prompt_like_the_reference_model() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf/tiny-kimi");
    let out = kiln(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "kiln serves coding agents",
        "--max-tokens",
        "6",
        "--ids",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("first decode step") && stderr.contains("tokens/s"),
        "{stderr}"
    );
    let mut tokens = ids_after("prompt ids:", &stdout);
    let completion = ids_after("completion ids:", &stdout);
    assert!(!completion.is_empty());
    let ckpt = Checkpoint::open(&dir).unwrap();
    let weights = ckpt.reference_weights().unwrap();
    let vocab = ckpt.spec.arch.vocab_size;
    for &got in &completion {
        let logits = forward_with_kv(&ckpt.spec.arch, &weights, &tokens, KvStorage::Bf16);
        let last = &logits[logits.len() - vocab..];
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
        let scale = last.iter().fold(0.0f64, |m, x| m.max(x.abs()));
        if last[order[0]] - last[order[1]] < 2f64.powi(-8) * scale {
            break; // a near-tie: either choice is right
        }
        assert_eq!(got as usize, order[0], "after {tokens:?}");
        tokens.push(got);
    }
}

#[test]
fn generate_names_a_missing_model_directory() {
    let out = kiln(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "hi",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/model"));
}

/// Kimi's chat format around one user message, as the server renders it.
const REVERSE_A_LIST: &str = "[BOS]<|im_user|>user<|im_middle|>Write a Python function that reverses a list.<|im_end|><|im_assistant|>assistant<|im_middle|>";

/// Without --model, `kiln generate` runs the embedded kiln-coder, which answers a request
/// for code with a Python code block that defines a function.
#[test]
fn the_default_model_answers_a_request_for_code_with_code() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "--prompt", REVERSE_A_LIST, "--max-tokens", "48"])
        .env("XDG_RUNTIME_DIR", std::env::temp_dir())
        .output()
        .expect("kiln runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.starts_with("```python\ndef "),
        "no Python code block with a function in {stdout:?}"
    );
}

/// `kiln perplexity` scores Python source it was not trained on (kiln's own tools) with the
/// embedded model far below the uniform guess over its vocabulary, and an fp8 cache changes
/// it little.
#[test]
fn the_default_model_predicts_python() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/hf_golden.py");
    let dir = tempfile::tempdir().unwrap();
    let mut ppl = Vec::new();
    for kv in ["bf16", "fp8"] {
        let json = dir.path().join(format!("{kv}.json"));
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["perplexity", file.to_str().unwrap(), "--window", "256"])
            .args(["--max-tokens", "512", "--kv-cache-dtype", kv])
            .args(["--json", json.to_str().unwrap()])
            .env("XDG_RUNTIME_DIR", std::env::temp_dir())
            .output()
            .expect("kiln runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(report["tokens"], 512);
        ppl.push(report["perplexity"].as_f64().unwrap());
    }
    // A model that knew nothing would be near the vocabulary's 8192 (HF transformers gives
    // 158 on this file's first 1024 tokens).
    assert!(ppl[0] < 512.0, "bf16 cache: perplexity {}", ppl[0]);
    assert!(
        (ppl[1] / ppl[0] - 1.0).abs() < 0.05,
        "fp8 cache moves perplexity from {} to {}",
        ppl[0],
        ppl[1]
    );
}
