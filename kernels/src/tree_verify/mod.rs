//! Verification of speculative token trees, one tree per request.
//!
//! A tree of `nodes` nodes per request: node 0 is the root (the last committed token),
//! `parents[i] < i` for every other node, `tokens[i]` the draft token of node `i`. Children
//! are visited in ascending index order. Both verifiers output, per request, the accepted
//! path (node indices, root excluded, `-1` after its end), its length and the bonus token
//! that follows it.
//! - Greedy: accept the child whose token equals the target's argmax at its parent; the
//!   bonus is the target's argmax at the last accepted node.
//! - Stochastic (SpecInfer's multi-step speculative sampling, lossless when each node's
//!   children are drawn i.i.d. from the draft distribution at that node): accept child `c`
//!   with token `x` when `u_c * q(x) < r(x)`, `r` being the current residual (initially the
//!   target distribution at the node); on rejection `r = norm(relu(r - q))` and the next
//!   sibling is tried; when no child is accepted the bonus is sampled from `r` with `u_n`.
//!   The uniforms come from the caller, so runs are reproducible and comparable with
//!   `kiln_reference::tree`.
//!
//! The greedy verifier takes one cube per request (SGLang's verify_tree_greedy does the
//! same). The stochastic walk is sequential by nature, but its vocabulary-wide work
//! (residual sums, sampling) is bandwidth: one cube streams a row at one SM's share of it,
//! so where the device lets every cube be resident at once (CUDA: `batch * cubes` at most
//! the SM count) a request's rows are split over several cubes that trade their sums
//! (`kernel.rs`).
mod kernel;

use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError};

/// Largest tree the verifiers take (one unit per node in the greedy kernel).
pub const MAX_NODES: usize = 256;
/// Most units per cube of the stochastic verifier: 512 units with 4 + 4 vector loads each in
/// flight (64 KB per SM) and registers to spare (1024 would cap them at 64 per unit).
const STOCHASTIC_MAX_UNITS: usize = 512;
/// Most cubes one request's rows are split over.
const MAX_SPLIT: usize = 64;
/// Fewest vectors in one cube's share of a row when the launcher picks the split.
const MIN_SHARE: usize = 2048;

/// A batch of token trees of `nodes` nodes each, on the device (`[batch, nodes]` arrays).
pub struct TreeBatch {
    pub batch: usize,
    pub nodes: usize,
    pub parents: DeviceArray<i32>,
    pub tokens: DeviceArray<u32>,
}

/// Where the verifiers write: `accepted` is `[batch, nodes]`, the others `[batch]`; the
/// stochastic verifier's cubes also trade sums through a private exchange area.
pub struct Verdicts {
    pub accepted: DeviceArray<i32>,
    pub accept_len: DeviceArray<u32>,
    pub bonus: DeviceArray<u32>,
    /// `batch` counters (zero) then `batch * nodes * max_split` words (empty); every launch
    /// leaves them so.
    exchange: DeviceArray<u32>,
}

impl Verdicts {
    /// Buffers for `batch` trees of `nodes` nodes; the outputs hold `i32::MIN` / `u32::MAX`
    /// until a verifier writes them.
    pub fn new<R: Runtime>(client: &ComputeClient<R>, batch: usize, nodes: usize) -> Self {
        let words = batch * nodes * max_split(client, batch);
        let exchange: Vec<u32> = std::iter::repeat_n(0, batch)
            .chain(std::iter::repeat_n(kernel::EMPTY, words))
            .collect();
        Self {
            accepted: DeviceArray::filled(client, batch * nodes, i32::MIN),
            accept_len: DeviceArray::filled(client, batch, u32::MAX),
            bonus: DeviceArray::filled(client, batch, u32::MAX),
            exchange: DeviceArray::upload(client, &exchange),
        }
    }
}

/// Most cubes per request that can all be resident at once: one cube per SM over the batch,
/// on a device that reports its SM count; 1 elsewhere (wgpu gives no such guarantee).
fn max_split<R: Runtime>(client: &ComputeClient<R>, batch: usize) -> usize {
    match client.properties().hardware.num_streaming_multiprocessors {
        Some(sms) => (sms as usize / batch.max(1)).clamp(1, MAX_SPLIT),
        None => 1,
    }
}

/// Greedy verification against the target's argmax at every node (`[batch, nodes]`).
pub fn verify_greedy<R: Runtime>(
    client: &ComputeClient<R>,
    trees: &TreeBatch,
    target_argmax: &DeviceArray<u32>,
    out: &Verdicts,
) -> Result<(), KernelError> {
    validate(client, trees, out)?;
    check_len("target argmax", target_argmax, trees.batch * trees.nodes)?;
    let units = trees.nodes.next_power_of_two() as u32;
    // SAFETY: validated above; parents are trusted to satisfy parents[i] < i.
    unsafe {
        kernel::verify_greedy_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(trees.batch as u32, 1, 1),
            CubeDim::new_1d(units),
            trees.parents.arg(),
            trees.tokens.arg(),
            target_argmax.arg(),
            out.accepted.arg(),
            out.accept_len.arg(),
            out.bonus.arg(),
            trees.nodes as u32,
            units,
        )
    }
    Ok(())
}

/// Stochastic verification. `target_probs` and `draft_probs` are `[batch, nodes, vocab]`
/// (row `i`: the next-token distribution after node `i`), `uniforms` `[batch, nodes + 1]`.
/// Each request's rows are split over [`stochastic_split`] cubes.
pub fn verify_stochastic<R: Runtime>(
    client: &ComputeClient<R>,
    trees: &TreeBatch,
    target_probs: &DeviceArray<f32>,
    draft_probs: &DeviceArray<f32>,
    uniforms: &DeviceArray<f32>,
    vocab: usize,
    out: &Verdicts,
) -> Result<(), KernelError> {
    let cubes = stochastic_split(client, trees.batch, vocab);
    verify_stochastic_split(
        client,
        trees,
        target_probs,
        draft_probs,
        uniforms,
        vocab,
        out,
        cubes,
    )
}

/// Cubes per request [`verify_stochastic`] takes: as many as can be resident together, each
/// share of a row at least [`MIN_SHARE`] vectors.
pub fn stochastic_split<R: Runtime>(
    client: &ComputeClient<R>,
    batch: usize,
    vocab: usize,
) -> usize {
    let vectors = vocab / vector_width(vocab);
    max_split(client, batch).min(vectors / MIN_SHARE).max(1)
}

/// [`verify_stochastic`] with each request's rows split over `cubes` cubes (for tests and
/// tuning). More than one needs a device that reports its SM count (CUDA) with `batch *
/// cubes` at most that count, so that every cube is resident while the others wait on it,
/// and at least one vector of the row per cube.
#[allow(clippy::too_many_arguments)]
pub fn verify_stochastic_split<R: Runtime>(
    client: &ComputeClient<R>,
    trees: &TreeBatch,
    target_probs: &DeviceArray<f32>,
    draft_probs: &DeviceArray<f32>,
    uniforms: &DeviceArray<f32>,
    vocab: usize,
    out: &Verdicts,
    cubes: usize,
) -> Result<(), KernelError> {
    validate(client, trees, out)?;
    if vocab == 0 || vocab > u32::MAX as usize {
        return Err(KernelError::Range {
            what: "vocab",
            value: vocab,
            min: 1,
            max: u32::MAX as usize,
        });
    }
    let rows = trees.batch * trees.nodes;
    check_len("target probabilities", target_probs, rows * vocab)?;
    check_len("draft probabilities", draft_probs, rows * vocab)?;
    check_len("uniforms", uniforms, trees.batch * (trees.nodes + 1))?;
    check_index_space("probabilities", rows * vocab)?;
    // Rows stream as 4-float vectors when they hold whole vectors.
    let width = vector_width(vocab);
    let vectors = vocab / width;
    let most = max_split(client, trees.batch).min(vectors);
    if cubes == 0 || cubes > most {
        return Err(KernelError::Range {
            what: "cubes per request",
            value: cubes,
            min: 1,
            max: most,
        });
    }
    check_len(
        "exchange (Verdicts::new for this batch and tree size)",
        &out.exchange,
        trees.batch + rows * max_split(client, trees.batch),
    )?;
    let units = stochastic_units(client, vectors.div_ceil(cubes));
    // SAFETY: validated above; parents are trusted to satisfy parents[i] < i; all
    // `batch * cubes` cubes fit on the device at once (one per SM) when `cubes > 1`.
    unsafe {
        kernel::verify_stochastic_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static((trees.batch * cubes) as u32, 1, 1),
            CubeDim::new_1d(units),
            width,
            trees.parents.arg(),
            trees.tokens.arg(),
            target_probs.arg(),
            draft_probs.arg(),
            target_probs.arg(),
            draft_probs.arg(),
            uniforms.arg(),
            out.accepted.arg(),
            out.accept_len.arg(),
            out.bonus.arg(),
            out.exchange.arg(),
            trees.nodes as u32,
            vocab as u32,
            cubes as u32,
            units,
        )
    }
    Ok(())
}

/// Floats per vector the stochastic verifier streams: 4 when rows hold whole vectors.
fn vector_width(vocab: usize) -> usize {
    match vocab % 4 {
        0 => 4,
        _ => 1,
    }
}

/// Units per stochastic cube: about eight vectors of a row each, a power of two from 32
/// (one group) to [`STOCHASTIC_MAX_UNITS`] or the device's limit.
fn stochastic_units<R: Runtime>(client: &ComputeClient<R>, vectors: usize) -> u32 {
    let hw = client.properties().hardware.max_units_per_cube as usize;
    let limit = STOCHASTIC_MAX_UNITS.min(1 << hw.max(32).ilog2());
    vectors.div_ceil(8).next_power_of_two().clamp(32, limit) as u32
}

fn validate<R: Runtime>(
    client: &ComputeClient<R>,
    trees: &TreeBatch,
    out: &Verdicts,
) -> Result<(), KernelError> {
    let props = client.properties();
    let max_nodes = MAX_NODES.min(props.hardware.max_units_per_cube as usize);
    if trees.nodes == 0 || trees.nodes > max_nodes {
        return Err(KernelError::Range {
            what: "tree nodes",
            value: trees.nodes,
            min: 1,
            max: max_nodes,
        });
    }
    let max_batch = props.hardware.max_cube_count.0 as usize;
    if trees.batch == 0 || trees.batch > max_batch {
        return Err(KernelError::Range {
            what: "batch",
            value: trees.batch,
            min: 1,
            max: max_batch,
        });
    }
    let cells = trees.batch * trees.nodes;
    check_len("parents", &trees.parents, cells)?;
    check_len("tokens", &trees.tokens, cells)?;
    check_len("accepted", &out.accepted, cells)?;
    check_len("accept_len", &out.accept_len, trees.batch)?;
    check_len("bonus", &out.bonus, trees.batch)
}
