//! Slicing a checkpoint into one tensor-parallel rank's weights, in the forms the loader
//! produces ([`LoadedWeight`]), named as in the checkpoint: what
//! `GpuModel::load_from` uploads for that rank. Which tensor splits along which axis is
//! [`Split::of`]; the design is in the module docs of [`super`].
//!
//! Invariants: the N slices of a tensor are contiguous, equal and in rank order, so they
//! reassemble to the original exactly. NVFP4 slices keep the matrix's global scale and the
//! E4M3 block scales of the elements they keep: along rows every slice is exact; along
//! columns (K) a slice must start and end on the 16-element scale blocks, else
//! [`SliceError::UnalignedNvfp4`].
use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;

use kiln_core::model::{ModelConfig, Tensor};
use kiln_core::nvfp4::{Nvfp4Matrix, BLOCK};

use super::TpError;
use crate::model::gpu::WeightSource;
use crate::model::weights::{needed_tensors, Needed, Role};
use crate::model::{Checkpoint, LoadError, LoadedWeight};

/// How one tensor is divided among the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it (norms, `q_a_proj`, `kv_a_proj_with_mqa`, the router).
    Replicated,
    /// Column-parallel: output features (rows of the `[out, in]` weight) in N slices.
    Rows,
    /// Row-parallel: input features (columns) in N slices; the outputs are partial sums.
    Cols,
    /// Vocabulary rows in N slices, each followed by one padding row of zeros.
    Vocab,
}

impl Split {
    /// The split of the tensor the checkpoint names `name`.
    pub fn of(name: &str) -> Split {
        const ROWS: [&str; 5] = ["q_b_proj", "q_proj", "kv_b_proj", "gate_proj", "up_proj"];
        const COLS: [&str; 2] = ["o_proj", "down_proj"];
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            return Split::Vocab;
        }
        let Some(module) = name
            .strip_suffix(".weight")
            .and_then(|p| p.rsplit('.').next())
        else {
            return Split::Replicated;
        };
        if ROWS.contains(&module) {
            Split::Rows
        } else if COLS.contains(&module) {
            Split::Cols
        } else {
            Split::Replicated
        }
    }
}

/// Why a weight cannot be sliced as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SliceError {
    #[error("a tensor of shape {shape:?} is not a matrix")]
    NotMatrix { shape: Vec<usize> },
    #[error("{axis} {start}..{end} are outside a weight with {len} {axis}")]
    OutOfRange {
        axis: &'static str,
        start: usize,
        end: usize,
        len: usize,
    },
    #[error("{len} {axis} do not split evenly over {ranks} ranks")]
    Uneven {
        axis: &'static str,
        len: usize,
        ranks: usize,
    },
    #[error(
        "NVFP4 columns {start}..{end} do not start and end on the {BLOCK}-element scale blocks"
    )]
    UnalignedNvfp4 { start: usize, end: usize },
}

/// `[rows, cols]` of a weight.
fn dims(w: &LoadedWeight) -> Result<(usize, usize), SliceError> {
    match w {
        LoadedWeight::Dense(t) if t.shape.len() == 2 => Ok((t.shape[0], t.shape[1])),
        LoadedWeight::Dense(t) => Err(SliceError::NotMatrix {
            shape: t.shape.clone(),
        }),
        LoadedWeight::Nvfp4(m) => Ok((m.rows, m.cols)),
    }
}

fn check_range(axis: &'static str, r: &Range<usize>, len: usize) -> Result<(), SliceError> {
    if r.start <= r.end && r.end <= len {
        Ok(())
    } else {
        Err(SliceError::OutOfRange {
            axis,
            start: r.start,
            end: r.end,
            len,
        })
    }
}

/// Elements `cols` of each of `rows` in a row-major buffer with rows of `row_len`.
fn block<T: Copy>(data: &[T], row_len: usize, rows: Range<usize>, cols: Range<usize>) -> Vec<T> {
    rows.flat_map(|r| &data[r * row_len + cols.start..r * row_len + cols.end])
        .copied()
        .collect()
}

/// The sub-matrix `rows x cols` of `w`; NVFP4 `cols` must lie on the scale blocks.
fn sub_matrix(
    w: &LoadedWeight,
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<LoadedWeight, SliceError> {
    let (n, k) = dims(w)?;
    check_range("rows", &rows, n)?;
    check_range("columns", &cols, k)?;
    let shape = vec![rows.len(), cols.len()];
    Ok(match w {
        LoadedWeight::Dense(t) => LoadedWeight::Dense(Tensor {
            data: block(&t.data, k, rows, cols),
            shape,
        }),
        LoadedWeight::Nvfp4(m) => {
            if !cols.start.is_multiple_of(BLOCK) || !cols.end.is_multiple_of(BLOCK) {
                return Err(SliceError::UnalignedNvfp4 {
                    start: cols.start,
                    end: cols.end,
                });
            }
            let codes = cols.start / 2..cols.end / 2;
            let scales = cols.start / BLOCK..cols.end / BLOCK;
            LoadedWeight::Nvfp4(Nvfp4Matrix {
                rows: shape[0],
                cols: shape[1],
                packed: block(&m.packed, k / 2, rows.clone(), codes),
                scales: block(&m.scales, k / BLOCK, rows, scales),
                global_scale: m.global_scale,
            })
        }
    })
}

/// Rows `rows` of `w` (all its columns).
pub fn slice_rows(w: &LoadedWeight, rows: Range<usize>) -> Result<LoadedWeight, SliceError> {
    sub_matrix(w, rows, 0..dims(w)?.1)
}

/// Columns `cols` of `w` (all its rows); for NVFP4 both ends must be multiples of 16.
pub fn slice_cols(w: &LoadedWeight, cols: Range<usize>) -> Result<LoadedWeight, SliceError> {
    sub_matrix(w, 0..dims(w)?.0, cols)
}

/// `w` with one more row, of zeros (NVFP4: zero codes and zero block scales).
fn pad_row(w: LoadedWeight) -> LoadedWeight {
    match w {
        LoadedWeight::Dense(mut t) => {
            t.data.extend(std::iter::repeat_n(0.0, t.shape[1]));
            t.shape[0] += 1;
            LoadedWeight::Dense(t)
        }
        LoadedWeight::Nvfp4(mut m) => {
            m.packed.extend(std::iter::repeat_n(0, m.cols / 2));
            m.scales.extend(std::iter::repeat_n(0, m.cols / BLOCK));
            m.rows += 1;
            LoadedWeight::Nvfp4(m)
        }
    }
}

/// The `rank`-th of `ranks` equal contiguous parts of `0..len`.
fn part(
    axis: &'static str,
    len: usize,
    rank: usize,
    ranks: usize,
) -> Result<Range<usize>, SliceError> {
    if ranks == 0 || !len.is_multiple_of(ranks) {
        return Err(SliceError::Uneven { axis, len, ranks });
    }
    let size = len / ranks;
    Ok(rank * size..(rank + 1) * size)
}

/// Rank `rank`'s part of `w` under `split`, one of `ranks` equal parts.
pub fn slice(
    w: &LoadedWeight,
    split: Split,
    rank: usize,
    ranks: usize,
) -> Result<LoadedWeight, SliceError> {
    match split {
        Split::Replicated => Ok(w.clone()),
        Split::Rows => slice_rows(w, part("rows", dims(w)?.0, rank, ranks)?),
        Split::Cols => slice_cols(w, part("columns", dims(w)?.1, rank, ranks)?),
        Split::Vocab => Ok(pad_row(slice_rows(
            w,
            part("rows", dims(w)?.0, rank, ranks)?,
        )?)),
    }
}

/// The architecture each of `ranks` ranks computes: its share of the heads and of every
/// intermediate width, its vocabulary slice plus the padding id, and an lm_head of its own
/// (a tied one is sliced from the embedding like an untied one).
pub fn rank_config(c: &ModelConfig, ranks: usize) -> Result<ModelConfig, TpError> {
    let share = |what: &'static str, value: usize| {
        if ranks > 0 && value.is_multiple_of(ranks) {
            Ok(value / ranks)
        } else {
            Err(TpError::Indivisible { what, value, ranks })
        }
    };
    Ok(ModelConfig {
        num_attention_heads: share("num_attention_heads", c.num_attention_heads)?,
        intermediate_size: share("intermediate_size", c.intermediate_size)?,
        moe_intermediate_size: share("moe_intermediate_size", c.moe_intermediate_size)?,
        vocab_size: share("vocab_size", c.vocab_size)? + 1,
        tie_word_embeddings: false,
        ..c.clone()
    })
}

/// One rank's weights, sliced from a checkpoint; the weight source of its device model.
pub struct RankWeights {
    /// This rank's index, `0..ranks`.
    pub rank: usize,
    /// How many ranks share the model.
    pub ranks: usize,
    /// The architecture this rank computes ([`rank_config`]).
    pub config: ModelConfig,
    tensors: HashMap<String, LoadedWeight>,
    /// The checkpoint's directory, for errors.
    dir: PathBuf,
}

impl RankWeights {
    /// The slice of the tensor the checkpoint names `name`.
    pub fn get(&self, name: &str) -> Option<&LoadedWeight> {
        self.tensors.get(name)
    }

    fn checked(&self, name: &str, shape: &[usize]) -> Result<&LoadedWeight, LoadError> {
        let w = self.get(name).ok_or_else(|| LoadError::MissingTensor {
            tensor: name.to_string(),
            files: 0,
        })?;
        let got = match w {
            LoadedWeight::Dense(t) => t.shape.clone(),
            LoadedWeight::Nvfp4(m) => vec![m.rows, m.cols],
        };
        if got != shape {
            return Err(LoadError::Shape {
                path: self.dir.clone(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                got,
            });
        }
        Ok(w)
    }
}

impl WeightSource for RankWeights {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn plain(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        match self.checked(name, shape)? {
            LoadedWeight::Dense(t) => Ok(t.clone()),
            LoadedWeight::Nvfp4(_) => Err(LoadError::Dtype {
                path: self.dir.clone(),
                tensor: name.to_string(),
                expected: "a plain tensor".into(),
                got: "NVFP4".into(),
            }),
        }
    }

    fn linear(&self, name: &str, shape: [usize; 2]) -> Result<LoadedWeight, LoadError> {
        self.checked(name, &shape).cloned()
    }
}

/// Rank `rank` of `ranks`: every tensor its architecture needs, loaded from `ckpt` and
/// sliced by [`Split::of`].
pub fn shard(ckpt: &Checkpoint, rank: usize, ranks: usize) -> Result<RankWeights, TpError> {
    if rank >= ranks {
        return Err(TpError::Rank { rank, ranks });
    }
    let full = &ckpt.spec.arch;
    let config = rank_config(full, ranks)?;
    let sources: HashMap<String, Needed> = needed_tensors(full)
        .into_iter()
        .map(|n| (n.name.clone(), n))
        .collect();
    let mut tensors = HashMap::new();
    for needed in needed_tensors(&config) {
        let source = match sources.get(&needed.name) {
            Some(n) => n.clone(),
            // A tied lm_head is the embedding, read as a linear weight (as the loader does).
            None => Needed {
                name: "model.embed_tokens.weight".into(),
                shape: vec![full.vocab_size, full.hidden_size],
                role: Role::Linear,
            },
        };
        let sliced = slice(&ckpt.load(&source)?, Split::of(&needed.name), rank, ranks).map_err(
            |source| TpError::Slice {
                tensor: needed.name.clone(),
                source,
            },
        )?;
        tensors.insert(needed.name, sliced);
    }
    Ok(RankWeights {
        rank,
        ranks,
        config,
        tensors,
        dir: ckpt.dir.clone(),
    })
}

#[cfg(test)]
#[path = "shard_tests.rs"]
mod tests;
