//! A decode batch padded to a fixed number of requests, as a CUDA graph replays it
//! (`graphs.rs`): padding rows repeat request 0's position and context, read token 0, and
//! write no KV row ([`PAD_SLOT`]); the block table is widened to a power of two, and the
//! attention kernel is shaped for the whole width (its longest context taken as the pages
//! the table holds), so a graph serves a batch's steps until a context outgrows the
//! width. Their inputs live in device buffers of their own, which a graph reads and which
//! are written over in place before each replay.
use cubecl::prelude::*;
use kiln_kernels::mla::{AttnMetadata, PAD_SLOT};
use kiln_kernels::DeviceArray;

use super::batch::{Layout, LogitRows, Plan};
use super::Batch;

/// A padded batch's inputs on the host.
pub(super) struct Padded {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub kv_lens: Vec<u32>,
    /// `[requests, max_blocks]`.
    pub block_table: Vec<u32>,
    pub max_blocks: usize,
    /// The sampling rows' words, when the step samples.
    pub params: Option<Vec<u32>>,
    /// The positions `max_blocks` pages hold: the longest context the step is shaped for.
    pub max_kv_len: usize,
}

/// A padded batch's inputs on the device, and the plan of a step over them.
pub(super) struct Inputs {
    pub plan: Plan,
    pub params: Option<DeviceArray<u32>>,
}

impl Batch {
    /// True when this is a decode step that can run padded: one new token per request, no
    /// draft tree, masks, log-probabilities or captured layers.
    pub(super) fn paddable(&self) -> bool {
        let one_row_each = match &self.logits {
            LogitRows::All | LogitRows::Last => true,
            LogitRows::Tails(tails) => tails.iter().all(|&n| n == 1),
        };
        one_row_each
            && self.capture.is_empty()
            && self.masks.is_empty()
            && self.logprobs.is_none()
            && (self.requests.iter()).all(|r| r.tokens.len() == 1 && r.tree.is_none())
    }
}

impl Padded {
    /// `batch` (laid out as `layout`, [`Batch::paddable`], over pages of `page_size`)
    /// padded to `size` requests.
    pub(super) fn new(batch: &Batch, layout: &Layout, size: usize, page_size: usize) -> Self {
        let n = batch.requests.len();
        debug_assert!(n <= size && batch.paddable());
        let source = |i: usize| if i < n { i } else { 0 };
        let pad = |mut v: Vec<u32>, with: u32| {
            v.resize(size, with);
            v
        };
        let max_blocks = layout.max_blocks.next_power_of_two();
        let mut block_table = vec![0u32; size * max_blocks];
        for (i, row) in block_table.chunks_mut(max_blocks).enumerate() {
            let table = &batch.requests[source(i)].block_table;
            row[..table.len()].copy_from_slice(table);
        }
        let kv_lens: Vec<u32> = (0..size)
            .map(|i| batch.requests[source(i)].kv_len as u32)
            .collect();
        Padded {
            tokens: pad(layout.tokens.clone(), 0),
            positions: pad(layout.positions.clone(), layout.positions[0]),
            slots: pad(layout.slots.clone(), PAD_SLOT),
            kv_lens,
            block_table,
            max_blocks,
            params: (batch.sampling.as_ref())
                .map(|rows| (0..size).flat_map(|i| rows[source(i)].words()).collect()),
            max_kv_len: max_blocks * page_size,
        }
    }

    /// Buffers of their own on the device, and the plan over them.
    pub(super) fn upload<R: Runtime>(&self, client: &ComputeClient<R>) -> Inputs {
        let size = self.tokens.len();
        let cu: Vec<u32> = (0..=size as u32).collect();
        let plan = Plan {
            num_tokens: size,
            tokens: DeviceArray::upload(client, &self.tokens),
            positions: DeviceArray::upload(client, &self.positions),
            slots: DeviceArray::upload(client, &self.slots),
            meta: AttnMetadata {
                batch: size,
                num_tokens: size,
                max_q_len: 1,
                max_kv_len: self.max_kv_len,
                cu_q_lens: DeviceArray::upload(client, &cu),
                kv_lens: DeviceArray::upload(client, &self.kv_lens),
                block_table: DeviceArray::upload(client, &self.block_table),
                max_blocks: self.max_blocks,
                tree_masks: None,
            },
            last_rows: None,
            per_head: None,
        };
        Inputs {
            plan,
            params: self.params.as_ref().map(|p| DeviceArray::upload(client, p)),
        }
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use std::path::Path;

    use kiln_backends::{Backend, Wgpu};
    use kiln_core::sampling::SamplingRow;
    use kiln_kernels::mla::KvFormat;
    use kiln_kernels::Precision;

    use super::*;
    use crate::model::gpu::{GpuModel, KvPool, RequestSlice};
    use crate::model::Checkpoint;

    const SENTINEL: u32 = 0x7fc0_dead;

    /// A pool of `pages` 4-row pages, every word a sentinel.
    fn pool<R: Runtime>(model: &GpuModel<R>, pages: usize) -> KvPool {
        let mut pool = model.kv_pool(pages, 4, KvFormat::Bf16);
        for cache in &mut pool.caches {
            cache.data = DeviceArray::filled(model.client(), cache.data.len(), SENTINEL);
        }
        pool
    }

    /// Request `i` holding `len` tokens, `new` of them new, in pages `8i..8i + 8` (reversed).
    fn slice(i: usize, len: usize, new: usize) -> RequestSlice {
        RequestSlice {
            tokens: (len - new..len)
                .map(|k| ((i * 31 + k * 7) % 64) as u32)
                .collect(),
            kv_len: len,
            block_table: (8 * i..8 * i + 8)
                .rev()
                .take(len.div_ceil(4))
                .map(|p| p as u32)
                .collect(),
            tree: None,
        }
    }

    /// The tiny NVFP4 Kimi fixture, and three requests of 5, 9 and 2 tokens: their prefill,
    /// and their next decode step.
    fn three_requests() -> (GpuModel<<Wgpu as Backend>::Runtime>, Batch, Batch) {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tiny-kimi-nvfp4");
        let ckpt = Checkpoint::open(&dir).unwrap();
        let model = GpuModel::load_with(Wgpu::client(), &ckpt, Precision::Exact).unwrap();
        let lens = [5, 9, 2];
        let prefill = Batch::new((0..3).map(|i| slice(i, lens[i], lens[i])).collect());
        let decode = Batch::last_logits((0..3).map(|i| slice(i, lens[i] + 1, 1)).collect());
        (model, prefill, decode)
    }

    /// Three requests decoding one token, padded to five: their rows' logits are the
    /// unpadded step's (within the f32 chain's rounding), the tokens drawn on the device
    /// with padded sampling rows are their greedy tokens, the padding rows' logits are
    /// finite, and nothing is written where the unpadded step writes nothing.
    #[test]
    fn padding_rows_compute_aside_and_write_no_kv() {
        let (model, prefill, mut decode) = three_requests();
        let (cl, vocab) = (model.client(), model.config.vocab_size);
        assert!(decode.paddable() && !prefill.paddable());

        let plain = pool(&model, 24);
        model.forward(&prefill, &plain).unwrap();
        let want = model.forward(&decode, &plain).unwrap();

        let padded_pool = pool(&model, 24);
        model.forward(&prefill, &padded_pool).unwrap();
        let layout = decode.layout(vocab, &padded_pool).unwrap();
        decode.sampling = Some(vec![SamplingRow::greedy(); 3]);
        let padded = Padded::new(&decode, &layout, 5, 4);
        assert_eq!(padded.max_blocks, 4, "3 pages widened to a power of two");
        assert_eq!(
            padded.max_kv_len, 16,
            "shaped for the 4 pages, not the 10 positions"
        );
        let inputs = padded.upload(cl);
        let issued = model.issue(&inputs.plan, &padded_pool, inputs.params.as_ref(), &decode);
        let issued = issued.unwrap();
        let got = issued.logits.read(cl);
        assert_eq!(got.len(), 5 * vocab);
        let (ids, _) = issued.sampled.expect("sampled on the device");
        let ids = ids.read(cl);

        let argmax = |row: &[f32]| (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]));
        for (r, want) in want.chunks(vocab).enumerate() {
            let got = &got[r * vocab..(r + 1) * vocab];
            let bound = 1e-4 * want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = (got.iter().zip(want)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= bound, "row {r}: off by {worst} (bound {bound})");
            assert_eq!(argmax(got), argmax(want), "row {r}'s greedy token");
            assert_eq!(
                argmax(want),
                Some(ids[r] as usize),
                "row {r} drawn on the device"
            );
        }
        assert!(
            got[3 * vocab..].iter().all(|v| v.is_finite()),
            "padding rows"
        );
        for (a, b) in plain.caches.iter().zip(&padded_pool.caches) {
            let unwritten = |words: Vec<u32>| -> Vec<bool> {
                words.into_iter().map(|w| w == SENTINEL).collect()
            };
            assert_eq!(
                unwritten(a.data.read(cl)),
                unwritten(b.data.read(cl)),
                "the padded step wrote where the plain one did not"
            );
        }
    }

    /// The padded step issued with its arrays carved from an arena (as a recorded graph's
    /// are: views at offsets into shared chunks) computes the same logits and tokens, bit
    /// for bit, as with memory of their own; once its outputs are dropped the arena holds
    /// no lease, and a second step reuses its chunks.
    #[test]
    fn a_step_carved_from_an_arena_computes_the_same_bits() {
        let (model, prefill, mut decode) = three_requests();
        let (cl, vocab) = (model.client(), model.config.vocab_size);
        decode.sampling = Some(vec![SamplingRow::greedy(); 3]);
        let arena = kiln_kernels::arena::Arena::new();
        let run = |carved: bool| {
            let kv = pool(&model, 24);
            model.forward(&prefill, &kv).unwrap();
            let layout = decode.layout(vocab, &kv).unwrap();
            let inputs = Padded::new(&decode, &layout, 4, 4).upload(cl);
            let _carving = carved.then(|| arena.install());
            let issued = model.issue(&inputs.plan, &kv, inputs.params.as_ref(), &decode);
            let issued = issued.unwrap();
            let bits: Vec<u32> = issued.logits.read(cl).iter().map(|v| v.to_bits()).collect();
            (bits, issued.sampled.expect("sampled").0.read(cl))
        };
        let own = run(false);
        assert_eq!(
            arena.bytes(),
            0,
            "nothing carved without the arena installed"
        );
        assert_eq!(run(true), own);
        let bytes = arena.bytes();
        assert!(bytes > 0);
        assert_eq!(arena.leased_bytes(), 0, "every array released");
        assert_eq!(run(true), own);
        assert_eq!(
            arena.bytes(),
            bytes,
            "the second step fits the first's chunks"
        );
    }
}
