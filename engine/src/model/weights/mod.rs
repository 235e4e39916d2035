//! The weights of an HF model directory: memory-mapped safetensors shards, validated against
//! the architecture the config declares, decoded from bf16, ModelOpt NVFP4,
//! compressed-tensors NVFP4 or compressed-tensors INT4 (converted to NVFP4).
//!
//! Nothing panics on a bad file: a truncated or corrupt shard, a missing tensor, a dtype or
//! shape that disagrees with the config each give a [`LoadError`] naming the file and tensor.
mod error;
mod expected;
mod formats;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::model::Tensor;
use kiln_core::nvfp4::Nvfp4Matrix;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

pub use error::LoadError;
pub use expected::{needed_tensors, Needed, Role};
pub use formats::LoadedWeight;
use formats::RawTensor;

use super::{ModelSpec, QuantMethod};

/// One mapped safetensors file and its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// An opened model directory: config plus mapped, header-validated weight shards.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub spec: ModelSpec,
    shards: Vec<Shard>,
    /// Tensor name -> shard index.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Reads `config.json`, maps every weight shard (`model.safetensors.index.json` when
    /// present, else `model*.safetensors`) and validates each header.
    pub fn open(dir: &Path) -> Result<Self, LoadError> {
        let spec = ModelSpec::from_dir(dir)?;
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for path in shard_paths(dir)? {
            let shard = map_shard(&path)?;
            for name in shard.tensors.keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(shard);
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            spec,
            shards,
            index,
        })
    }

    /// True when some shard holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn raw(&self, name: &str) -> Result<RawTensor<'_>, LoadError> {
        let missing = || LoadError::MissingTensor {
            tensor: name.to_string(),
            files: self.shards.len(),
        };
        let shard = &self.shards[*self.index.get(name).ok_or_else(missing)?];
        let (key, info) = shard.tensors.get_key_value(name).ok_or_else(missing)?;
        let (start, end) = info.data_offsets;
        Ok(RawTensor {
            path: &shard.path,
            name: key,
            dtype: info.dtype,
            shape: &info.shape,
            bytes: &shard.mmap[shard.data_start + start..shard.data_start + end],
        })
    }

    /// A plain (never quantized) tensor as f32, checked against `shape`.
    pub fn plain(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        let raw = self.raw(name)?;
        raw.expect_shape(shape)?;
        Ok(Tensor {
            shape: shape.to_vec(),
            data: raw.to_f32()?,
        })
    }

    /// A linear weight `X.weight` of `shape = [out, in]`, in whichever format it is stored.
    pub fn linear(&self, name: &str, shape: [usize; 2]) -> Result<LoadedWeight, LoadError> {
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let part = |suffix: &str| self.raw(&format!("{prefix}.{suffix}"));
        if self.contains(&format!("{prefix}.weight_scale_2")) {
            let m = formats::modelopt(
                &part("weight")?,
                &part("weight_scale")?,
                &part("weight_scale_2")?,
                shape,
            )?;
            return Ok(LoadedWeight::Nvfp4(m));
        }
        if self.contains(&format!("{prefix}.weight_scale_inv")) {
            let weight = part("weight")?;
            let QuantMethod::Fp8Block { block } = self.spec.quant else {
                return Err(LoadError::Format {
                    path: weight.path.to_path_buf(),
                    tensor: format!("{prefix}.weight_scale_inv"),
                    reason: "block scales, but the config's quantization_config is not fp8".into(),
                });
            };
            let w = formats::fp8_block(&weight, &part("weight_scale_inv")?, shape, block)?;
            if !name.contains(".mlp.experts.") {
                return Ok(LoadedWeight::Dense(Tensor {
                    shape: shape.to_vec(),
                    data: w,
                }));
            }
            let m =
                Nvfp4Matrix::quantize(&w, shape[0], shape[1]).map_err(|e| LoadError::Format {
                    path: weight.path.to_path_buf(),
                    tensor: weight.name.to_string(),
                    reason: format!("FP8 -> NVFP4 conversion: {e}"),
                })?;
            return Ok(LoadedWeight::Nvfp4(m));
        }
        if self.contains(&format!("{prefix}.weight_packed")) {
            let packed = part("weight_packed")?;
            if packed.dtype == Dtype::U8 {
                let g = part("weight_global_scale")?;
                let m = formats::ct_nvfp4(&packed, &part("weight_scale")?, &g, shape)?;
                return Ok(LoadedWeight::Nvfp4(m));
            }
            let w = formats::ct_int4(&packed, &part("weight_scale")?, shape)?;
            let m =
                Nvfp4Matrix::quantize(&w, shape[0], shape[1]).map_err(|e| LoadError::Format {
                    path: packed.path.to_path_buf(),
                    tensor: packed.name.to_string(),
                    reason: format!("INT4 -> NVFP4 conversion: {e}"),
                })?;
            return Ok(LoadedWeight::Nvfp4(m));
        }
        Ok(LoadedWeight::Dense(self.plain(name, &shape)?))
    }

    /// Loads one needed tensor.
    pub fn load(&self, needed: &Needed) -> Result<LoadedWeight, LoadError> {
        match needed.role {
            Role::Plain => Ok(LoadedWeight::Dense(
                self.plain(&needed.name, &needed.shape)?,
            )),
            Role::Linear => self.linear(&needed.name, [needed.shape[0], needed.shape[1]]),
        }
    }

    /// Every tensor the architecture needs, decoded and dequantized to f32 by HF name (the
    /// input of `kiln_core::model::forward`), with a progress bar on a terminal.
    pub fn reference_weights(&self) -> Result<HashMap<String, Tensor>, LoadError> {
        let needed = needed_tensors(&self.spec.arch);
        let bar = progress_bar(needed.len());
        let mut out = HashMap::with_capacity(needed.len());
        for n in &needed {
            bar.set_message(n.name.clone());
            out.insert(n.name.clone(), self.load(n)?.dequantize());
            bar.inc(1);
        }
        bar.finish_and_clear();
        Ok(out)
    }
}

/// The bar shown while tensors load (drawn only on a terminal).
pub(crate) fn progress_bar(tensors: usize) -> ProgressBar {
    ProgressBar::new(tensors as u64).with_style(
        ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {msg}")
            .expect("static template"),
    )
}

/// The shard files of a directory.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| LoadError::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::Config {
                path: index.clone(),
                reason: e.to_string(),
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| LoadError::Config {
                path: index.clone(),
                reason: "no weight_map object".into(),
            })?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadError::NoWeights {
            dir: dir.to_path_buf(),
        });
    }
    Ok(files)
}

fn map_shard(path: &Path) -> Result<Shard, LoadError> {
    let file = File::open(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the mapping is read-only; kiln never writes checkpoint files, and a checkpoint
    // modified while kiln runs is outside what it can defend against.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let (header_len, metadata): (usize, Metadata) =
        SafeTensors::read_metadata(&mmap).map_err(|e| LoadError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let tensors = metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect();
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        data_start: 8 + header_len,
        tensors,
    })
}
