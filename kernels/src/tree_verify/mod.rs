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
//! One cube per request (SGLang's verify_tree_greedy / tree_speculative_sampling follow the
//! same split). The walk along the tree is sequential by nature; the vocabulary-wide work
//! (residual updates, sampling) is spread over the cube's units.
mod kernel;

use cubecl::prelude::*;

use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError};

/// Largest tree the verifiers take (one unit per node in the greedy kernel).
pub const MAX_NODES: usize = 256;
/// Most units per cube of the stochastic verifier: 512 units with 4 + 4 vector loads each in
/// flight (64 KB per SM) and registers to spare (1024 would cap them at 64 per unit).
const STOCHASTIC_MAX_UNITS: usize = 512;

/// A batch of token trees of `nodes` nodes each, on the device (`[batch, nodes]` arrays).
pub struct TreeBatch {
    pub batch: usize,
    pub nodes: usize,
    pub parents: DeviceArray<i32>,
    pub tokens: DeviceArray<u32>,
}

/// Where the verifiers write: `accepted` is `[batch, nodes]`, the others `[batch]`.
pub struct Verdicts {
    pub accepted: DeviceArray<i32>,
    pub accept_len: DeviceArray<u32>,
    pub bonus: DeviceArray<u32>,
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
pub fn verify_stochastic<R: Runtime>(
    client: &ComputeClient<R>,
    trees: &TreeBatch,
    target_probs: &DeviceArray<f32>,
    draft_probs: &DeviceArray<f32>,
    uniforms: &DeviceArray<f32>,
    vocab: usize,
    out: &Verdicts,
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
    let width = match vocab % 4 {
        0 => 4,
        _ => 1,
    };
    let units = stochastic_units(client, vocab / width);
    // SAFETY: validated above; parents are trusted to satisfy parents[i] < i.
    unsafe {
        kernel::verify_stochastic_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(trees.batch as u32, 1, 1),
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
            trees.nodes as u32,
            vocab as u32,
            units,
        )
    }
    Ok(())
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
