//! Text in and out: the directory's `tokenizer.json` (HF `tokenizers` format, e.g. Kimi's
//! byte-level BPE) and, when `tokenizer_config.json` has one, its chat template (kept as
//! text for the server's chat endpoint). Token ids are the engine's currency: text is only
//! converted at the edges, since text -> ids -> text -> ids is not the identity.
use std::path::{Path, PathBuf};

use super::LoadError;

/// A model directory's tokenizer.
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    /// `chat_template` from `tokenizer_config.json`, if any.
    pub chat_template: Option<String>,
}

fn tok_error(path: &Path, e: impl std::fmt::Display) -> LoadError {
    LoadError::Config {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

impl TextCodec {
    /// Loads `dir/tokenizer.json` (and the chat template of `dir/tokenizer_config.json`).
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(LoadError::Io {
                path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no tokenizer.json"),
            });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&path).map_err(|e| tok_error(&path, e))?;
        let config: PathBuf = dir.join("tokenizer_config.json");
        let chat_template = std::fs::read_to_string(&config)
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|v| {
                v.get("chat_template")
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
            });
        Ok(TextCodec {
            tokenizer,
            chat_template,
        })
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }
}
