//! The models kiln carries in its binary, so `kiln serve` and `kiln generate` run on a
//! fresh checkout or an installed binary without a download. `--model` takes a directory
//! or one of these names:
//! - `kiln-coder` (the default): a small DeepSeek-V3-architecture model trained on
//!   permissively licensed Python and chat turns in Kimi's format by
//!   tools/train_coder.py, routed experts in NVFP4 (engine/assets/kiln-coder/, whose
//!   DATA.md lists the training data and its licences);
//! - `kiln-tiny-random`: random weights, loaded in milliseconds, for tests of the engine
//!   (its outputs mean nothing).
use std::path::{Path, PathBuf};

use anyhow::Context;
use kiln::model::default_model;

/// The model served when `--model` is not given.
pub const DEFAULT: &str = CODER;
const CODER: &str = "kiln-coder";
const CODER_FILES: [(&str, &[u8]); 3] = [
    (
        "config.json",
        include_bytes!("../../assets/kiln-coder/config.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../assets/kiln-coder/tokenizer.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../assets/kiln-coder/model.safetensors"),
    ),
];

/// A model directory to load: its path, the name to serve it under, and whether it was
/// written for this run (to remove once loaded).
pub struct ModelDir {
    pub dir: PathBuf,
    pub name: String,
    pub temporary: bool,
}

/// `--model`'s value (a directory, or an embedded model's name; none: [`DEFAULT`]) as a
/// directory: an embedded model is written under the system's temp directory.
pub fn resolve(model: Option<&Path>) -> anyhow::Result<ModelDir> {
    let model = model.unwrap_or(Path::new(DEFAULT));
    let name = model.to_string_lossy();
    let embedded = |dir: PathBuf| ModelDir {
        dir,
        name: name.to_string(),
        temporary: true,
    };
    if !model.exists() {
        if name == CODER {
            return Ok(embedded(
                write_coder().context("writing the embedded kiln-coder")?,
            ));
        }
        if name == default_model::NAME {
            return Ok(embedded(
                default_model::materialize().context("writing the tiny model")?,
            ));
        }
    }
    let name = model
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    Ok(ModelDir {
        dir: model.to_path_buf(),
        name,
        temporary: false,
    })
}

fn write_coder() -> std::io::Result<PathBuf> {
    let dir = default_model::fresh_dir(CODER)?;
    for (file, bytes) in CODER_FILES {
        std::fs::write(dir.join(file), bytes)?;
    }
    Ok(dir)
}
