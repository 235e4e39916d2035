//! A Kimi-format tokenizer directory (`tiktoken.model` + `tokenizer_config.json`, as Kimi's
//! repos ship them) loads, and encodes as the `tiktoken` package itself does with Kimi's
//! split pattern: `tools/tiktoken_case.py` trains ranks with tiktoken's reference trainer,
//! writes the directory and tiktoken's own ids for texts in several scripts (plain, and with
//! special tokens). Needs python3 with `tiktoken` (`.ci/setup` installs it).
use std::path::Path;
use std::process::Command;

use kiln::model::tokenizer::TextCodec;
use serde_json::Value;

#[test]
fn a_kimi_tiktoken_directory_encodes_as_tiktoken_does() {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/tiktoken_case.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(dir.path())
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{} (needs the tiktoken package): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.path().join("tokenizer.json").exists());
    let codec = TextCodec::from_dir(dir.path()).unwrap();
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("cases.json")).unwrap())
            .unwrap();
    let ranks = cases["ranks"].as_u64().unwrap() as u32;
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = match case["special"].as_bool().unwrap() {
            true => codec.encode(text),
            false => codec.encode_plain(text),
        }
        .unwrap();
        assert_eq!(got, want, "{text:?}");
        assert_eq!(codec.decode_with_special(&got).unwrap(), text);
    }
    // Kimi's special-id layout: 256 ids after the ranks, named ones and reserved ones.
    assert_eq!(codec.vocab_size(), ranks as usize + 256);
    assert_eq!(codec.token_id("[BOS]"), Some(ranks));
    assert_eq!(codec.token_id("<|im_end|>"), Some(ranks + 7));
    let reserved = format!("<|reserved_token_{}|>", ranks + 3);
    assert_eq!(codec.token_id(&reserved), Some(ranks + 3));
}

#[test]
fn a_corrupt_tiktoken_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiktoken.model"), "IQ== 0\nnot-base64! 1\n").unwrap();
    let err = TextCodec::from_dir(dir.path())
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("tiktoken.model") && err.contains("line 2"),
        "{err}"
    );
}
