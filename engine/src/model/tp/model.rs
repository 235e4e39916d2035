//! The sharded forward on one device: N ranks' device models (each built from its
//! [`super::shard`]) run one after another, piece by piece, and at each all-reduce point
//! their partial results are read back, summed on the host in rank order (f32, as an NCCL
//! sum would) and uploaded to every rank; the logits of the vocabulary slices are gathered
//! on the host. It computes exactly what N GPUs would, which tests TP's arithmetic against
//! TP = 1 on any single device; the multi-GPU version replaces [`all_reduce`] with NCCL.
use cubecl::prelude::*;
use kiln_core::model::ModelConfig;
use kiln_kernels::mla::KvFormat;
use kiln_kernels::DeviceArray;
use kiln_kernels::Precision;

use super::shard::shard;
use super::TpError;
use crate::model::gpu::{Batch, GpuModel, KvPool, ModelError, RankStep};
use crate::model::Checkpoint;

/// A model split over `ranks` tensor-parallel ranks, all on one device.
pub struct ShardedModel<R: Runtime> {
    /// The whole model's architecture.
    pub config: ModelConfig,
    ranks: Vec<GpuModel<R>>,
}

/// One paged KV pool per rank (the latent cache is replicated: every rank writes the same
/// rows), sharing one page table.
pub struct ShardedKvPool {
    pools: Vec<KvPool>,
}

impl<R: Runtime> ShardedModel<R> {
    /// Slices `ckpt` into `ranks` ranks and uploads each to the device of `client`.
    pub fn load(
        client: ComputeClient<R>,
        ckpt: &Checkpoint,
        ranks: usize,
    ) -> Result<Self, TpError> {
        let models = (0..ranks)
            .map(|r| {
                Ok(GpuModel::load_from(
                    client.clone(),
                    &shard(ckpt, r, ranks)?,
                    Precision::default(),
                )?)
            })
            .collect::<Result<Vec<_>, TpError>>()?;
        if models.is_empty() {
            return Err(TpError::Rank { rank: 0, ranks });
        }
        Ok(ShardedModel {
            config: ckpt.spec.arch.clone(),
            ranks: models,
        })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks.len()
    }

    /// A pool per rank of `num_pages` pages of `page_size` tokens per layer.
    pub fn kv_pool(&self, num_pages: usize, page_size: usize, format: KvFormat) -> ShardedKvPool {
        ShardedKvPool {
            pools: self
                .ranks
                .iter()
                .map(|m| m.kv_pool(num_pages, page_size, format))
                .collect(),
        }
    }

    /// Runs one step on every rank, all-reducing after the embedding and after each
    /// attention and FFN block: the batch's logits, `[rows, vocab]`, as
    /// [`GpuModel::forward`] returns them.
    pub fn forward(&self, batch: &Batch, pool: &ShardedKvPool) -> Result<Vec<f32>, TpError> {
        if !batch.capture.is_empty() {
            return Err(TpError::Unsupported(
                "capturing hidden states under tensor parallelism".into(),
            ));
        }
        if batch.sampling.is_some() {
            // Each rank holds a slice of the vocabulary: a draw would need the ranks'
            // maxima, sums and race winners reduced across them.
            return Err(TpError::Unsupported(
                "sampling on the device under tensor parallelism".into(),
            ));
        }
        let layers = self.config.num_hidden_layers;
        if pool.pools.len() != self.ranks.len()
            || pool.pools.iter().any(|p| p.caches.len() != layers)
        {
            return Err(TpError::Unsupported(format!(
                "a KV pool of another model (this one has {} ranks of {layers} layers)",
                self.ranks.len()
            )));
        }
        let per_rank = self.config.vocab_size / self.ranks.len();
        let batches = (0..self.ranks.len())
            .map(|r| rank_batch(batch, self.config.vocab_size, r, per_rank))
            .collect::<Result<Vec<_>, _>>()?;
        let mut steps = self
            .ranks
            .iter()
            .zip(&batches)
            .zip(&pool.pools)
            .map(|((m, b), p)| m.rank_step(b, p))
            .collect::<Result<Vec<_>, _>>()?;
        let client = self.ranks[0].client();
        all_reduce(client, &mut steps, |s| &mut s.residual);
        for layer in 0..layers {
            for s in &steps {
                s.attention(layer)?;
            }
            all_reduce(client, &mut steps, |s| &mut s.delta);
            for s in &steps {
                s.ffn(layer)?;
            }
            all_reduce(client, &mut steps, |s| &mut s.delta);
        }
        let slices = steps
            .into_iter()
            .map(RankStep::logits)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(gather_vocab(&slices, per_rank))
    }
}

/// Sums the buffer `pick` selects over the ranks, in rank order in f32, and gives every
/// rank the sum: the all-reduce, done on the host.
fn all_reduce<'a, R: Runtime>(
    client: &ComputeClient<R>,
    steps: &mut [RankStep<'a, R>],
    pick: impl for<'s> Fn(&'s mut RankStep<'a, R>) -> &'s mut DeviceArray<f32>,
) {
    let mut sum = pick(&mut steps[0]).read(client);
    for s in steps[1..].iter_mut() {
        for (acc, v) in sum.iter_mut().zip(pick(s).read(client)) {
            *acc += v;
        }
    }
    for s in steps.iter_mut() {
        *pick(s) = DeviceArray::upload(client, &sum);
    }
}

/// `batch` as rank `rank` sees it: token ids of its vocabulary slice (`per_rank` ids from
/// `rank * per_rank`) become local ids, every other id its padding id `per_rank`.
fn rank_batch(batch: &Batch, vocab: usize, rank: usize, per_rank: usize) -> Result<Batch, TpError> {
    let mut out = batch.clone();
    for (b, req) in out.requests.iter_mut().enumerate() {
        if let Some(&t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Batch(format!(
                "request {b}: token id {t} is outside the vocabulary of {vocab}"
            ))
            .into());
        }
        req.tokens = rank_tokens(&req.tokens, rank, per_rank);
    }
    Ok(out)
}

/// Rank-local ids: `t - rank * per_rank` inside the rank's slice, `per_rank` outside it.
fn rank_tokens(tokens: &[u32], rank: usize, per_rank: usize) -> Vec<u32> {
    let start = rank * per_rank;
    tokens
        .iter()
        .map(|&t| match (t as usize).checked_sub(start) {
            Some(local) if local < per_rank => local as u32,
            _ => per_rank as u32,
        })
        .collect()
}

/// Each rank's `[rows, per_rank + 1]` logits to `[rows, ranks * per_rank]`: a row's slices
/// in rank order, each without its padding column.
fn gather_vocab(slices: &[Vec<f32>], per_rank: usize) -> Vec<f32> {
    let rows = slices[0].len() / (per_rank + 1);
    (0..rows)
        .flat_map(|row| {
            let at = row * (per_rank + 1);
            slices
                .iter()
                .flat_map(move |s| s[at..at + per_rank].iter().copied())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_outside_a_ranks_slice_become_its_padding_id() {
        let tokens = [0, 3, 4, 7, 8, 11];
        assert_eq!(rank_tokens(&tokens, 0, 4), vec![0, 3, 4, 4, 4, 4]);
        assert_eq!(rank_tokens(&tokens, 1, 4), vec![4, 4, 0, 3, 4, 4]);
        assert_eq!(rank_tokens(&tokens, 2, 4), vec![4, 4, 4, 4, 0, 3]);
    }

    #[test]
    fn gathered_logits_concatenate_slices_without_padding_columns() {
        // Two rows, two ranks of two ids each; the padding logit is -1.
        let rank0 = vec![0.0, 1.0, -1.0, 10.0, 11.0, -1.0];
        let rank1 = vec![2.0, 3.0, -1.0, 12.0, 13.0, -1.0];
        assert_eq!(
            gather_vocab(&[rank0, rank1], 2),
            vec![0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
        );
    }
}
