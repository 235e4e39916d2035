//! Decode steps replayed as CUDA graphs (issue 29): on the routed runtime
//! (`kiln_backends::routed`), where every launch lands on kiln's stream, a decode step's
//! kernels (the same calls [`GpuModel::launch`] issues) are recorded once per shape and then
//! replayed with a single launch. That takes the host's per-kernel issue cost out of the
//! step.
//!
//! A batch of one new token per request (no draft tree, masks, log-probabilities or
//! captured layers) runs padded to the smallest of the model's batch sizes that holds it:
//! padding rows repeat request 0's position and context, read token 0, and write no KV row
//! ([`PAD_SLOT`]). A graph is keyed by that size, the block table's width (rounded up to a
//! power of two), the attention kernel's form and split count
//! ([`kiln_kernels::mla::decode_launch`]) and whether the step samples. Its inputs (ids,
//! positions, slots, KV lengths, block table, sampling rows) live in device buffers of its
//! own, written in place before each replay (`routed::write`), and its outputs are read
//! after it. The first step of a shape runs eagerly, which compiles its kernels, and is
//! then recorded. A graph holds the memory its recording allocated
//! (`routed::Captured`).
//!
//! A replayed step computes what the eager step of the same padded batch computes, bit for
//! bit. A batch smaller than its padded size can differ from its unpadded eager step in
//! rounding: the attention split count depends on the batch size.
use std::collections::HashMap;

use cubecl::prelude::*;
use kiln_backends::routed::{self, Captured, KilnCuda};
use kiln_kernels::mla::{decode_launch, AttnMetadata, PAD_SLOT};
use kiln_kernels::DeviceArray;

use super::batch::{Issued, Layout, LogitRows, Plan, Reads};
use super::{Batch, GpuModel, KvPool, ModelError};

/// The recorded decode graphs of a model, by shape.
pub(super) struct StepGraphs {
    /// Batch sizes graphs are recorded at, ascending.
    sizes: Vec<usize>,
    graphs: HashMap<Key, StepGraph>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    batch: usize,
    max_blocks: usize,
    attention: Option<(bool, usize)>,
    samples: bool,
}

/// One recorded step: its input buffers, the graph, and what it leaves on the device.
struct StepGraph {
    inputs: Inputs,
    graph: Captured,
    issued: Issued,
}

/// A graph's inputs on the device.
struct Inputs {
    plan: Plan,
    params: Option<DeviceArray<u32>>,
}

/// A padded batch's inputs on the host, in the order [`Inputs`] holds them.
struct Padded {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    kv_lens: Vec<u32>,
    block_table: Vec<u32>,
    params: Option<Vec<u32>>,
    max_kv_len: usize,
}

impl StepGraphs {
    pub(super) fn new(mut sizes: Vec<usize>) -> Self {
        sizes.sort_unstable();
        sizes.dedup();
        StepGraphs {
            sizes,
            graphs: HashMap::new(),
        }
    }
}

/// True when `batch` is a decode step a graph can replay.
fn replayable(batch: &Batch) -> bool {
    let one_row_each = match &batch.logits {
        LogitRows::All | LogitRows::Last => true,
        LogitRows::Tails(tails) => tails.iter().all(|&n| n == 1),
    };
    one_row_each
        && batch.capture.is_empty()
        && batch.masks.is_empty()
        && batch.logprobs.is_none()
        && (batch.requests.iter()).all(|r| r.tokens.len() == 1 && r.tree.is_none())
}

impl Padded {
    /// `batch` (laid out as `layout`) padded to `size` requests with a block table
    /// `max_blocks` wide.
    fn new(batch: &Batch, layout: &Layout, size: usize, max_blocks: usize) -> Self {
        let n = batch.requests.len();
        let pad = |mut v: Vec<u32>, with: u32| {
            v.resize(size, with);
            v
        };
        let kv_lens: Vec<u32> = batch.requests.iter().map(|r| r.kv_len as u32).collect();
        let mut block_table = vec![0u32; size * max_blocks];
        for (i, row) in block_table.chunks_mut(max_blocks).enumerate() {
            let table = &batch.requests[if i < n { i } else { 0 }].block_table;
            row[..table.len()].copy_from_slice(table);
        }
        let params = batch.sampling.as_ref().map(|rows| {
            (0..size)
                .flat_map(|i| rows[if i < n { i } else { 0 }].words())
                .collect()
        });
        Padded {
            tokens: pad(layout.tokens.clone(), 0),
            positions: pad(layout.positions.clone(), layout.positions[0]),
            slots: pad(layout.slots.clone(), PAD_SLOT),
            kv_lens: pad(kv_lens, batch.requests[0].kv_len as u32),
            block_table,
            params,
            max_kv_len: batch.requests.iter().map(|r| r.kv_len).max().unwrap_or(1),
        }
    }

    /// Buffers of their own on the device, and the plan over them.
    fn upload(&self, client: &ComputeClient<KilnCuda>, max_blocks: usize) -> Inputs {
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
                max_blocks,
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

    /// Writes them over `inputs` in place, in stream order.
    fn write(&self, client: &ComputeClient<KilnCuda>, inputs: &Inputs) -> Result<(), ModelError> {
        let p = &inputs.plan;
        let mut writes = vec![
            (&p.tokens, &self.tokens),
            (&p.positions, &self.positions),
            (&p.slots, &self.slots),
            (&p.meta.kv_lens, &self.kv_lens),
            (&p.meta.block_table, &self.block_table),
        ];
        if let (Some(device), Some(host)) = (&inputs.params, &self.params) {
            writes.push((device, host));
        }
        for (device, host) in writes {
            routed::write(client, device, host).map_err(|e| ModelError::Device(e.to_string()))?;
        }
        Ok(())
    }
}

impl<R: Runtime> GpuModel<R> {
    /// Replays decode steps of up to the largest of `sizes` requests from CUDA graphs, a
    /// batch padded to the smallest size that holds it (module docs). Only on the routed
    /// runtime (`kiln_backends::routed::KilnCuda`, the `cuda-routed` backend).
    pub fn enable_graphs(&mut self, sizes: Vec<usize>) -> Result<(), ModelError> {
        if self.routed().is_none() {
            return Err(ModelError::Unsupported(
                "CUDA graphs need the cuda-routed backend".into(),
            ));
        }
        if sizes.is_empty() || sizes.contains(&0) {
            return Err(ModelError::Unsupported(format!(
                "graph batch sizes {sizes:?}: at least one, none zero"
            )));
        }
        self.graphs = Some(std::sync::Mutex::new(StepGraphs::new(sizes)));
        Ok(())
    }

    /// The client as the routed runtime's, if it is one.
    fn routed(&self) -> Option<&ComputeClient<KilnCuda>> {
        (&self.client as &dyn std::any::Any).downcast_ref()
    }

    /// Replays `batch` from a CUDA graph when the model keeps graphs and the batch is a
    /// decode step one holds (recording it first if none does yet): the step's reads, and
    /// the rows and width of its logits that are the batch's. `None`: issue it eagerly.
    pub(super) fn replayed(
        &self,
        batch: &Batch,
        pool: &KvPool,
        previous: Option<&DeviceArray<u32>>,
    ) -> Result<Option<(Reads<'_>, (usize, usize))>, ModelError> {
        let Some(graphs) = &self.graphs else {
            return Ok(None);
        };
        let client = self
            .routed()
            .expect("graphs are enabled on the routed runtime only");
        let mut graphs = graphs.lock().expect("decode graphs");
        let n = batch.requests.len();
        let size = graphs.sizes.iter().copied().find(|&s| s >= n);
        let (Some(size), true) = (size, replayable(batch)) else {
            return Ok(None);
        };
        let layout = batch.layout(self.config.vocab_size, pool)?;
        let max_blocks = layout.max_blocks.next_power_of_two();
        let padded = Padded::new(batch, &layout, size, max_blocks);
        let format = pool.caches[0].format;
        let key = Key {
            batch: size,
            max_blocks,
            attention: decode_launch(
                client,
                self.config.num_attention_heads,
                format,
                self.precision,
                (size, 1, padded.max_kv_len),
            ),
            samples: padded.params.is_some(),
        };
        let rows = (n, self.config.vocab_size);
        if let Some(graph) = graphs.graphs.get(&key) {
            padded.write(client, &graph.inputs)?;
            if !batch.from_previous.is_empty() {
                self.fed(previous, &batch.from_previous, &graph.inputs.plan.tokens)?;
            }
            routed::replay(client, &graph.graph).map_err(|e| ModelError::Device(e.to_string()))?;
            self.launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(Some((graph.issued.reads(&self.client), rows)));
        }
        // First of its shape: run eagerly (compiling its kernels), then record it.
        let inputs = padded.upload(client, max_blocks);
        if !batch.from_previous.is_empty() {
            self.fed(previous, &batch.from_previous, &inputs.plan.tokens)?;
        }
        let step =
            |model: &Self| model.issue(&inputs.plan, pool, &[], inputs.params.as_ref(), batch);
        let reads = step(self)?.reads(&self.client);
        let (graph, issued) = routed::capture(client, || step(self))
            .map_err(|e| ModelError::Device(e.to_string()))?;
        tracing::info!(
            batch = size,
            max_blocks,
            attention = ?key.attention,
            held_mib = graph.kept_bytes() as f64 / (1 << 20) as f64,
            "recorded a decode step as a CUDA graph"
        );
        graphs.graphs.insert(
            key,
            StepGraph {
                inputs,
                graph,
                issued,
            },
        );
        Ok(Some((reads, rows)))
    }
}
