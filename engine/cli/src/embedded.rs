//! The models kiln carries in its binary, so `kiln serve` and `kiln generate` run on a
//! fresh checkout or an installed binary without a download. `--model` takes a directory
//! or one of these names:
//! - `kiln-coder` (the default): a small DeepSeek-V3-architecture model trained on
//!   permissively licensed Python and chat turns in Kimi's format by
//!   tools/train_coder.py, routed experts in NVFP4 (engine/assets/kiln-coder/, whose
//!   DATA.md lists the training data and its licences);
//! - `kiln-tiny-random`: random weights, loaded in milliseconds, for tests of the engine
//!   (its outputs mean nothing).
//!
//! kiln-coder's 43 MB come with the `coder` feature (on by default); builds without it
//! (the GPU machine's, whose copies are size-limited) take `--model DIR` instead.
use std::path::{Path, PathBuf};

use anyhow::Context;
use kiln::model::default_model;
use kiln::model::tokenizer::TextCodec;
use kiln::model::Checkpoint;

/// The model served when `--model` is not given.
pub const DEFAULT: &str = CODER;
const CODER: &str = "kiln-coder";
#[cfg(feature = "coder")]
const CODER_FILES: [(&str, &[u8]); 4] = [
    (
        "config.json",
        include_bytes!("../../assets/kiln-coder/config.json"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../../assets/kiln-coder/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../assets/kiln-coder/tokenizer_config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../../assets/kiln-coder/model.safetensors"),
    ),
];

/// A model opened for loading: its checkpoint, its tokenizer and the name to serve it
/// under.
pub struct Opened {
    pub ckpt: Checkpoint,
    pub codec: TextCodec,
    pub name: String,
    /// An embedded model (written out for this run, and removed again once opened: its
    /// shards stay mapped).
    pub embedded: bool,
}

/// Opens `--model`'s value: a directory, or an embedded model's name (none: [`DEFAULT`]),
/// which is written under the system's temp directory first.
pub fn open(model: Option<&Path>) -> anyhow::Result<Opened> {
    let model = model.unwrap_or(Path::new(DEFAULT));
    let given = model.to_string_lossy();
    let written = match given.as_ref() {
        _ if model.exists() => None,
        CODER => Some(write_coder().context("writing the embedded kiln-coder")?),
        default_model::NAME => {
            Some(default_model::materialize().context("writing the tiny model")?)
        }
        _ => None,
    };
    let dir = written.as_deref().unwrap_or(model);
    let ckpt = Checkpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let codec = TextCodec::from_dir(dir)?;
    let name = match &written {
        Some(w) => {
            let _ = std::fs::remove_dir_all(w);
            given.into_owned()
        }
        None => model
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
    };
    Ok(Opened {
        ckpt,
        codec,
        name,
        embedded: written.is_some(),
    })
}

#[cfg(feature = "coder")]
fn write_coder() -> anyhow::Result<PathBuf> {
    let dir = default_model::fresh_dir(CODER)?;
    for (file, bytes) in CODER_FILES {
        std::fs::write(dir.join(file), bytes)?;
    }
    Ok(dir)
}

#[cfg(not(feature = "coder"))]
fn write_coder() -> anyhow::Result<PathBuf> {
    anyhow::bail!(
        "this kiln was built without the `coder` feature: pass --model with the directory \
         engine/assets/kiln-coder (or another model)"
    )
}
