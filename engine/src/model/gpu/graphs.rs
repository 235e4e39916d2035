//! Decode steps replayed as CUDA graphs (issue 29): on the routed runtime
//! (`kiln_backends::routed`), where every launch lands on kiln's stream, a decode step's
//! kernels (the same calls [`GpuModel::launch`] issues) are recorded once per shape and then
//! replayed with a single launch. That takes the host's per-kernel issue cost out of the
//! step.
//!
//! A decode batch ([`Batch::paddable`]) runs padded to the smallest of the model's batch
//! sizes that holds it (`padded.rs`). A graph is keyed by that size, the padded block
//! table's width, the attention kernel's form and split count
//! ([`kiln_kernels::mla::decode_launch`], chosen for the table's width, so they change
//! only with it: a request's growing context is recorded once per power of two of its
//! pages) and whether the step samples. Its inputs live in device buffers of its own,
//! written in place before each replay (`routed::write_all`, their addresses resolved
//! when the graph is recorded), and
//! its outputs are read after it. The first step of a shape runs eagerly, which compiles
//! its kernels, and is then recorded. The arrays a step allocates are carved from one
//! arena all the graphs share (`kiln_kernels::arena`): a range freed inside a step is
//! reused later in it, and one graph's scratch is another's, since graphs run one at a
//! time on kiln's stream. Each graph's outputs stay leased to it; they are read (and a
//! next step's tokens fed from them) before the next step runs. A graph also holds what
//! its recording allocated outside the arena (`routed::Captured`); at most
//! [`MAX_GRAPHS`] are kept, the least recently run dropped first.
//!
//! A replayed step computes what the eager step of the same padded batch computes, bit for
//! bit. A batch smaller than its padded size can differ from its unpadded eager step in
//! rounding: the attention split count depends on the batch size.
use std::collections::HashMap;

use cubecl::prelude::*;
use kiln_backends::routed::{self, Captured, KilnCuda, Target};
use kiln_kernels::arena::Arena;
use kiln_kernels::mla::{decode_launch, MmaShape};
use kiln_kernels::DeviceArray;

use super::batch::{Issued, Reads};
use super::padded::{Inputs, Padded};
use super::{Batch, GpuModel, GraphStats, KvPool, ModelError};

/// Graphs a model keeps at most: recording one more drops the least recently replayed
/// (contexts that grow move a session's steps through block-table widths, and each graph
/// holds its step's scratch).
const MAX_GRAPHS: usize = 24;

/// A replayed step's reads, and the rows and width of its logits that are the batch's.
type Replayed<'a> = (Reads<'a>, (usize, usize));

/// The recorded decode graphs of a model, by shape.
pub(super) struct StepGraphs {
    /// Batch sizes graphs are recorded at, ascending.
    sizes: Vec<usize>,
    graphs: HashMap<Key, StepGraph>,
    /// Steps replayed or recorded so far (the graphs' clock).
    steps: u64,
    /// Graphs recorded so far (those dropped included).
    recorded: u64,
    /// The memory every graph's scratch and outputs are carved from (`kiln_kernels::arena`).
    arena: Arena,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    batch: usize,
    max_blocks: usize,
    attention: Option<MmaShape>,
    samples: bool,
}

/// One recorded step: its input buffers, the graph, and what it leaves on the device.
struct StepGraph {
    inputs: Inputs,
    /// Where [`writes`]' buffers of `inputs` live, in its order.
    targets: Vec<Target<u32>>,
    graph: Captured,
    /// The memory `graph` holds outside the arena.
    bytes: u64,
    issued: Issued,
    /// The clock when it last ran.
    used: u64,
}

impl StepGraphs {
    pub(super) fn new(mut sizes: Vec<usize>) -> Self {
        sizes.sort_unstable();
        sizes.dedup();
        StepGraphs {
            sizes,
            graphs: HashMap::new(),
            steps: 0,
            recorded: 0,
            arena: Arena::new(),
        }
    }
}

impl<R: Runtime> GpuModel<R> {
    /// Replays decode steps of up to the largest of `sizes` requests from CUDA graphs, a
    /// batch padded to the smallest size that holds it (module docs). Only on the routed
    /// runtime (`kiln_backends::routed::KilnCuda`, the `cuda-routed` backend).
    pub fn enable_graphs(&mut self, sizes: Vec<usize>) -> Result<(), ModelError> {
        if self.routed().is_none() {
            return Err(ModelError::Graphs(
                "they need the cuda-routed backend".into(),
            ));
        }
        if sizes.is_empty() || sizes.contains(&0) {
            return Err(ModelError::Graphs(format!(
                "batch sizes {sizes:?}: at least one, none zero"
            )));
        }
        self.graphs = Some(std::sync::Mutex::new(StepGraphs::new(sizes)));
        Ok(())
    }

    /// What the model's decode graphs hold and have done (`None`: graphs are off).
    pub fn graph_stats(&self) -> Option<GraphStats> {
        let graphs = self.graphs.as_ref()?.lock().expect("decode graphs");
        Some(GraphStats {
            held: graphs.graphs.len(),
            held_bytes: graphs.arena.bytes() + graphs.graphs.values().map(|g| g.bytes).sum::<u64>(),
            recorded: graphs.recorded,
            replayed: graphs.steps - graphs.recorded,
        })
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
    ) -> Result<Option<Replayed<'_>>, ModelError> {
        let Some(graphs) = &self.graphs else {
            return Ok(None);
        };
        let client = self
            .routed()
            .expect("graphs are enabled on the routed runtime only");
        let mut graphs = graphs.lock().expect("decode graphs");
        let n = batch.requests.len();
        let size = graphs.sizes.iter().copied().find(|&s| s >= n);
        let (Some(size), true) = (size, batch.paddable()) else {
            return Ok(None);
        };
        let layout = batch.layout(self.config.vocab_size, pool)?;
        let padded = Padded::new(batch, &layout, size, pool.page_size);
        let format = pool.caches[0].format;
        let key = Key {
            batch: size,
            max_blocks: padded.max_blocks,
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
        graphs.steps += 1;
        let now = graphs.steps;
        if let Some(graph) = graphs.graphs.get_mut(&key) {
            graph.used = now;
            let hosts = writes(&padded, &graph.inputs)
                .into_iter()
                .map(|(_, host)| host);
            let inputs: Vec<_> = graph.targets.iter().zip(hosts).collect();
            routed::write_all(client, &inputs).map_err(|e| ModelError::Graphs(e.to_string()))?;
            if !batch.from_previous.is_empty() {
                self.fed(previous, &batch.from_previous, &graph.inputs.plan.tokens)?;
            }
            routed::replay(client, &graph.graph).map_err(|e| ModelError::Graphs(e.to_string()))?;
            self.launches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(Some((graph.issued.reads(&self.client), rows)));
        }
        // First of its shape: run eagerly (compiling its kernels), then record it.
        let inputs = padded.upload(client);
        if !batch.from_previous.is_empty() {
            self.fed(previous, &batch.from_previous, &inputs.plan.tokens)?;
        }
        let arena = graphs.arena.clone();
        let step = |model: &Self| {
            let _carved = arena.install();
            model.issue(&inputs.plan, pool, inputs.params.as_ref(), batch)
        };
        // The eager step grows the arena to what the step needs, outside the capture.
        let reads = step(self)?.reads(&self.client);
        let before = arena.bytes();
        let (graph, issued) = routed::capture(client, || step(self))
            .map_err(|e| ModelError::Graphs(e.to_string()))?;
        // What the recording allocated that the arena does not hold.
        let bytes = (graph.kept_bytes()).saturating_sub(arena.bytes() - before);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        tracing::info!(
            batch = size,
            max_blocks = key.max_blocks,
            attention = ?key.attention,
            arena_mib = mib(arena.bytes()),
            leased_mib = mib(arena.leased_bytes()),
            own_mib = mib(bytes),
            "recorded a decode step as a CUDA graph"
        );
        if graphs.graphs.len() >= MAX_GRAPHS {
            let oldest = (graphs.graphs.iter())
                .min_by_key(|(_, g)| g.used)
                .map(|(k, _)| *k);
            // Its last replay finishes before its memory may be handed out again.
            cubecl::future::block_on(client.sync())
                .map_err(|e| ModelError::Graphs(e.to_string()))?;
            graphs.graphs.remove(&oldest.expect("graphs are kept"));
        }
        let targets = (writes(&padded, &inputs).into_iter())
            .map(|(device, _)| Target::of(client, device))
            .collect::<Result<_, _>>()
            .map_err(|e| ModelError::Graphs(e.to_string()))?;
        let used = now;
        graphs.recorded += 1;
        graphs.graphs.insert(
            key,
            StepGraph {
                inputs,
                targets,
                graph,
                bytes,
                issued,
                used,
            },
        );
        Ok(Some((reads, rows)))
    }
}

/// Each of `inputs`' buffers that changes from step to step, with what it is to hold for
/// `padded` (`inputs` uploaded from a batch of the same size and widths).
fn writes<'a>(padded: &'a Padded, inputs: &'a Inputs) -> Vec<(&'a DeviceArray<u32>, &'a [u32])> {
    let p = &inputs.plan;
    let mut writes = vec![
        (&p.tokens, padded.tokens.as_slice()),
        (&p.positions, &padded.positions),
        (&p.slots, &padded.slots),
        (&p.meta.kv_lens, &padded.kv_lens),
        (&p.meta.block_table, &padded.block_table),
    ];
    if let (Some(device), Some(host)) = (&inputs.params, &padded.params) {
        writes.push((device, host));
    }
    writes
}
