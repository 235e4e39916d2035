//! Text in and out: the directory's `tokenizer.json` (HF `tokenizers` format) or its
//! `tiktoken.model` (Kimi's BPE ranks as its repos ship them) and, when `tokenizer_config.json` has one, its chat template (kept as
//! text for the server's chat endpoint). Token ids are the engine's currency: text is only
//! converted at the edges, since text -> ids -> text -> ids is not the identity.
use std::path::{Path, PathBuf};

use super::LoadError;

/// A model directory's tokenizer.
#[derive(Clone)]
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    /// The same tokenizer with special-token strings encoded as plain text (chat content).
    plain: tokenizers::Tokenizer,
    /// `chat_template` from `tokenizer_config.json`, if any.
    pub chat_template: Option<String>,
    /// `bos_token` and `eos_token` from `tokenizer_config.json` (templates write them).
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

fn tok_error(path: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::Config {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl TextCodec {
    /// Loads `dir/tokenizer.json`, or else `dir/tiktoken.model` (Kimi's BPE ranks with its
    /// split pattern and special tokens, [`super::tiktoken`]), and the chat template of
    /// `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let config_path: PathBuf = dir.join("tokenizer_config.json");
        let config = match std::fs::read_to_string(&config_path) {
            Ok(text) => Some(
                serde_json::from_str::<serde_json::Value>(&text)
                    .map_err(|e| tok_error(&config_path, e))?,
            ),
            Err(_) => None,
        };
        let path = dir.join("tokenizer.json");
        let tiktoken = dir.join(super::tiktoken::FILE);
        let tokenizer = if path.exists() {
            let json = std::fs::read_to_string(&path).map_err(|source| LoadError::Io {
                path: path.clone(),
                source,
            })?;
            Self::parse(&json).map_err(|e| tok_error(&path, e))?
        } else if tiktoken.exists() {
            super::tiktoken::load(dir, config.as_ref()).map_err(|e| tok_error(&tiktoken, e))?
        } else {
            return Err(LoadError::Io {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no tokenizer.json or tiktoken.model",
                ),
            });
        };
        let chat_template = config
            .as_ref()
            .and_then(|v| v.get("chat_template"))
            .and_then(|t| t.as_str())
            .map(str::to_string);
        // A special token is written as its string or as an AddedToken's dict.
        let token = |key: &str| {
            let v = config.as_ref()?.get(key)?;
            v.as_str()
                .or_else(|| v.get("content")?.as_str())
                .map(str::to_string)
        };
        let mut codec = Self::from_tokenizer(tokenizer, chat_template);
        codec.bos_token = token("bos_token");
        codec.eos_token = token("eos_token");
        Ok(codec)
    }

    /// A tokenizer from the text of a `tokenizer.json`.
    pub fn parse(json: &str) -> Result<tokenizers::Tokenizer, String> {
        json.parse::<tokenizers::Tokenizer>()
            .map_err(|e| e.to_string())
    }

    /// The codec of a tokenizer.
    pub fn from_tokenizer(tokenizer: tokenizers::Tokenizer, chat_template: Option<String>) -> Self {
        let mut plain = tokenizer.clone();
        plain.set_encode_special_tokens(true);
        TextCodec {
            tokenizer,
            plain,
            chat_template,
            bos_token: None,
            eos_token: None,
        }
    }

    /// The added tokens (Kimi's and chat formats' special tokens among them) and their ids:
    /// the strings that `encode` turns into single tokens.
    pub fn added_tokens(&self) -> Vec<(String, u32)> {
        (self.tokenizer.get_added_tokens_decoder().into_iter())
            .map(|(id, t)| (t.content, id))
            .collect()
    }

    /// The id of a (special) token, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Tokens in the vocabulary, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// An upper bound on the bytes of input text one token stands for: four times the
    /// longest token string (byte-level and SentencePiece token strings are at least as
    /// long as the bytes they decode to; the factor covers normalizers that shrink text,
    /// as NFKC does ligatures). Walks the vocabulary: call it once.
    pub fn max_token_bytes(&self) -> usize {
        let longest = (self.tokenizer.get_vocab(true).keys())
            .map(String::len)
            .max()
            .unwrap_or(1);
        4 * longest.max(1)
    }

    /// Token ids of `text` with special-token strings treated as text.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.plain
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Text of `ids` with special tokens written out.
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, false).map_err(|e| e.to_string())
    }

    /// Token ids of `text` (no special tokens added; special-token strings in it become
    /// their tokens).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The bytes token `id` stands for: its byte-level string read back through the
    /// alphabet, or else (SentencePiece, added tokens outside the alphabet) its decoded text.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let bytes: Option<Vec<u8>> =
            (self.tokenizer.id_to_token(id)).and_then(|t| t.chars().map(byte_of).collect());
        bytes.unwrap_or_else(|| {
            self.decode_with_special(&[id])
                .unwrap_or_default()
                .into_bytes()
        })
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }
}

/// The byte a character of GPT-2's byte-level alphabet stands for (`None` outside it).
fn byte_of(c: char) -> Option<u8> {
    static TABLE: std::sync::OnceLock<Vec<Option<u8>>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let alphabet = byte_level_alphabet();
        let mut table = vec![None; alphabet.iter().map(|&c| c as usize + 1).max().unwrap_or(0)];
        for (b, &c) in alphabet.iter().enumerate() {
            table[c as usize] = Some(b as u8);
        }
        table
    });
    table.get(c as usize).copied().flatten()
}

/// GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE
/// writes it in token strings (printable Latin-1 as itself, the rest from U+0100 on).
pub(crate) fn byte_level_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut chars = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        chars[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    chars
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_is_gpt2s() {
        let c = byte_level_alphabet();
        assert_eq!(
            (c[b'!' as usize], c[b' ' as usize], c[b'\n' as usize]),
            ('!', '\u{120}', '\u{10a}')
        );
        let distinct: std::collections::HashSet<char> = c.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
        assert!((0..=255u8).all(|b| byte_of(c[b as usize]) == Some(b)));
        assert_eq!(byte_of('\u{2603}'), None);
    }
}
