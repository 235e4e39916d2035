//! Tokenizers shipped as tiktoken BPE ranks, as Kimi's Hugging Face repos ship them: a
//! `tiktoken.model` (one `base64(token bytes) rank` a line), the split pattern of
//! `tokenization_kimi.py`, and special tokens at the ids past the ranks (256 of them,
//! named by `tokenizer_config.json`'s `added_tokens_decoder`, the rest
//! `<|reserved_token_{id}|>`).
//!
//! The ranks are loaded into a `tokenizers` byte-level BPE, written as the `tokenizer.json`
//! it would be: the vocabulary is every ranked token; the merges are, for each token in
//! rank order, the two parts tiktoken's own byte-pair merge reaches just before it (merging
//! only tokens of lower rank), as Hugging Face converts Llama 3's ranks; a piece that is a
//! whole token is that token (`ignore_merges`, tiktoken's first rule). So it encodes as
//! tiktoken does, which the tests check against the `tiktoken` package itself.
use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

use super::tokenizer::byte_level_alphabet;

/// `pat_str` of Kimi K2's `tokenization_kimi.py`: Han runs apart from other letters.
pub const KIMI_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Special-token ids past the ranks (`num_reserved_special_tokens`).
pub const RESERVED_SPECIAL: u32 = 256;

/// The tiktoken file of a model directory.
pub const FILE: &str = "tiktoken.model";

/// The ranks of a tiktoken file's text: token bytes by rank, ranks `0..n` each once.
pub fn parse_ranks(text: &str) -> Result<Vec<Vec<u8>>, String> {
    let mut tokens: Vec<Option<Vec<u8>>> = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let bad = |why: &str| format!("line {}: {why}", i + 1);
        let mut fields = line.split_whitespace();
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad("expected `base64-token rank`"));
        };
        let bytes = base64_decode(b64).ok_or_else(|| bad("the token is not base64"))?;
        let rank: usize = rank.parse().map_err(|_| bad("the rank is not a number"))?;
        if rank >= tokens.len() {
            tokens.resize(rank + 1, None);
        }
        if tokens[rank].replace(bytes).is_some() {
            return Err(bad(&format!("rank {rank} appears twice")));
        }
    }
    tokens
        .into_iter()
        .enumerate()
        .map(|(rank, t)| t.ok_or(format!("rank {rank} is missing")))
        .collect()
}

/// Standard base64 (RFC 4648, padded), as tiktoken files write tokens.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let s = s.as_bytes();
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (i, chunk) in s.chunks(4).enumerate() {
        let last = i + 1 == s.len() / 4;
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut word = 0u32;
        for &c in &chunk[..4 - pad] {
            word = word << 6 | u32::from(value(c)?);
        }
        word <<= 6 * pad as u32;
        out.extend_from_slice(&word.to_be_bytes()[1..4 - pad]);
    }
    Some(out)
}

/// The parts tiktoken's byte-pair merge leaves `token` in when only tokens ranked below
/// `rank` may form: two for a token BPE training made.
fn parts_below(ranks: &HashMap<&[u8], usize>, token: &[u8], rank: usize) -> Vec<(usize, usize)> {
    let mut parts: Vec<(usize, usize)> = (0..token.len()).map(|i| (i, i + 1)).collect();
    loop {
        let best = (0..parts.len().saturating_sub(1))
            .filter_map(|i| {
                let r = *ranks.get(&token[parts[i].0..parts[i + 1].1])?;
                (r < rank).then_some((r, i))
            })
            .min();
        let Some((_, i)) = best else {
            return parts;
        };
        parts[i].1 = parts[i + 1].1;
        parts.remove(i + 1);
    }
}

/// The `tokenizer.json` of `ranks` split by `pattern`, with `specials` (name, id) added.
pub fn tokenizer_json(ranks: &[Vec<u8>], pattern: &str, specials: &[(String, u32)]) -> Value {
    let chars = byte_level_alphabet();
    let text = |bytes: &[u8]| bytes.iter().map(|&b| chars[b as usize]).collect::<String>();
    let by_bytes: HashMap<&[u8], usize> = ranks
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let vocab: serde_json::Map<String, Value> = ranks
        .iter()
        .enumerate()
        .map(|(r, t)| (text(t), json!(r)))
        .collect();
    let merges: Vec<Value> = ranks
        .iter()
        .enumerate()
        .filter(|(_, t)| t.len() > 1)
        .filter_map(
            |(rank, t)| match parts_below(&by_bytes, t, rank).as_slice() {
                [a, b] => Some(json!([text(&t[a.0..a.1]), text(&t[b.0..b.1])])),
                _ => None,
            },
        )
        .collect();
    let added: Vec<Value> = specials
        .iter()
        .map(|(content, id)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": true, "vocab": vocab, "merges": merges},
    })
}

/// Kimi's special tokens for `base` ranks: ids `base..base + 256`, named from
/// `tokenizer_config.json`'s `added_tokens_decoder` where it names them.
pub fn kimi_specials(base: u32, config: Option<&Value>) -> Result<Vec<(String, u32)>, String> {
    let mut named: HashMap<u32, String> = HashMap::new();
    if let Some(decoder) = config
        .and_then(|c| c.get("added_tokens_decoder"))
        .and_then(Value::as_object)
    {
        for (id, token) in decoder {
            let id: u32 = id
                .parse()
                .map_err(|_| format!("added_tokens_decoder id {id:?}"))?;
            let content = token.get("content").and_then(Value::as_str);
            let content = content.ok_or(format!("added_tokens_decoder {id} has no content"))?;
            if !(base..base + RESERVED_SPECIAL).contains(&id) {
                return Err(format!(
                    "added token {content:?} has id {id}, outside the special ids {base}..{}",
                    base + RESERVED_SPECIAL
                ));
            }
            named.insert(id, content.to_string());
        }
    }
    Ok((base..base + RESERVED_SPECIAL)
        .map(|id| {
            (
                named
                    .remove(&id)
                    .unwrap_or(format!("<|reserved_token_{id}|>")),
                id,
            )
        })
        .collect())
}

/// The tokenizer of `dir/tiktoken.model` with Kimi's pattern and special tokens (the
/// tokenizer config, if any, parsed by the caller).
pub fn load(dir: &Path, config: Option<&Value>) -> Result<tokenizers::Tokenizer, String> {
    let path = dir.join(FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let ranks = parse_ranks(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let specials = kimi_specials(ranks.len() as u32, config)?;
    let json = tokenizer_json(&ranks, KIMI_PATTERN, &specials).to_string();
    let tokenizer: tokenizers::Tokenizer = json.parse().map_err(|e| format!("{e}"))?;
    // Added tokens take the next free ids in order: check they landed where Kimi puts them.
    for (name, id) in &specials {
        if tokenizer.token_to_id(name) != Some(*id) {
            return Err(format!("special token {name:?} did not get id {id}"));
        }
    }
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_as_tiktoken_writes_it() {
        assert_eq!(base64_decode("IQ==").unwrap(), b"!");
        assert_eq!(base64_decode("aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode("IGZvbw==").unwrap(), b" foo");
        assert_eq!(base64_decode("4oCc").unwrap(), "\u{201c}".as_bytes());
        assert!(base64_decode("a=bc").is_none() && base64_decode("abc").is_none());
    }

    #[test]
    fn bad_rank_files_are_named() {
        assert!(parse_ranks("IQ== 0\naGk= 0\n")
            .unwrap_err()
            .contains("twice"));
        assert!(parse_ranks("IQ== 1\n")
            .unwrap_err()
            .contains("rank 0 is missing"));
        assert!(parse_ranks("IQ==\n").unwrap_err().contains("line 1"));
        assert_eq!(
            parse_ranks("aGk= 1\nIQ== 0\n").unwrap(),
            vec![b"!".to_vec(), b"hi".to_vec()]
        );
    }

    #[test]
    fn specials_fill_the_reserved_ids() {
        let config = json!({"added_tokens_decoder": {"10": {"content": "[BOS]"}, "12": {"content": "<|im_end|>"}}});
        let s = kimi_specials(10, Some(&config)).unwrap();
        assert_eq!(s.len(), 256);
        assert_eq!(
            (s[0].0.as_str(), s[1].0.as_str(), s[2].0.as_str()),
            ("[BOS]", "<|reserved_token_11|>", "<|im_end|>")
        );
        let outside = json!({"added_tokens_decoder": {"3": {"content": "x"}}});
        assert!(kimi_specials(10, Some(&outside)).is_err());
    }
}
