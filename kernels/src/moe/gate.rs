//! The router, as HF transformers' `DeepseekV3TopkRouter` computes it (in f32): scores =
//! sigmoid(logits); choice = scores + bias; group score = sum of the group's top-2 choices;
//! the `topk_group` best groups are kept and the others' choices masked to minus infinity
//! (transformers 5.x, SGLang and DeepSeek's code; some 4.x releases filled 0.0); the top `k`
//! choices are picked (ties to the lower index) and
//! weighted by their unbiased scores, normalised to sum 1 (+1e-20) when `norm_topk_prob`,
//! times `routed_scaling_factor`. Oracle: `kiln_reference::moe_gate::route`.
//!
//! One cube per token: units compute the scores and the group scores into shared memory, and
//! each of the `k` picks is a cube-wide argmax (every unit scans its strided experts, then a
//! tree over the units). A single unit walking `k` passes over 384 experts took 36 us per
//! token on the H200, 8% of a Kimi layer's decode step (`benches/RESULTS.md`).
use cubecl::prelude::*;

use crate::buffer::check_len;
use crate::{DeviceArray, KernelError};

/// Most routed experts the router takes (Kimi K2 has 384).
pub const MAX_EXPERTS: usize = 512;
const MAX_TOP_K: usize = 16;
/// Most expert groups the router takes.
const MAX_GROUPS: usize = 64;
const UNITS: u32 = 64;

/// Router hyper-parameters, as the HF config names them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateParams {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

/// Where the router writes: `[tokens, k]` expert ids and weights.
pub struct Routing {
    pub experts: DeviceArray<u32>,
    pub weights: DeviceArray<f32>,
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn route_kernel(
    logits: &Array<f32>,
    bias: &Array<f32>,
    experts_out: &mut Array<u32>,
    weights_out: &mut Array<f32>,
    n_experts: u32,
    top_k: u32,
    n_group: u32,
    topk_group: u32,
    norm: u32,
    scaling: f32,
) {
    let t = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let e_count = n_experts as usize;
    let groups = n_group as usize;
    let per_group = e_count / groups;
    let mut scores = SharedMemory::<f32>::new(MAX_EXPERTS);
    let mut choice = SharedMemory::<f32>::new(MAX_EXPERTS);
    let mut group_score = SharedMemory::<f32>::new(MAX_GROUPS);
    let mut kept = SharedMemory::<u32>::new(MAX_GROUPS);
    let mut best_value = SharedMemory::<f32>::new(UNITS as usize);
    let mut best_index = SharedMemory::<u32>::new(UNITS as usize);
    let mut picked = SharedMemory::<u32>::new(MAX_TOP_K);
    for e in range_stepped(unit, e_count, UNITS as usize) {
        let s = 1.0 / (1.0 + (-logits[t * e_count + e]).exp());
        scores[e] = s;
        choice[e] = s + bias[e];
    }
    sync_cube();
    // A group's score: the sum of its two best choices. When every group is kept the scores
    // cannot matter and the scan (one unit over all 384 experts for Kimi K2's single group)
    // is skipped.
    for g in range_stepped(unit, groups, UNITS as usize) {
        let (mut a, mut b) = (f32::new(-3.0e38), f32::new(-3.0e38));
        if topk_group < n_group {
            for i in 0..per_group {
                let c = choice[g * per_group + i];
                if c > a {
                    b = a;
                    a = c;
                } else if c > b {
                    b = c;
                }
            }
        }
        group_score[g] = a + b;
        kept[g] = 0;
    }
    sync_cube();
    if unit == 0 {
        // Keep the topk_group best groups (at most 64 x 64 reads; Kimi K2 has one group).
        for _pass in 0..topk_group {
            let mut best_g = 0usize;
            let mut best = f32::new(-3.0e38);
            let mut found = false;
            for g in 0..groups {
                let score = group_score[g];
                if kept[g] == 0 && (!found || score > best) {
                    best = score;
                    best_g = g;
                    found = true;
                }
            }
            kept[best_g] = 1;
        }
    }
    sync_cube();
    for e in range_stepped(unit, e_count, UNITS as usize) {
        if kept[e / per_group] == 0 {
            choice[e] = f32::new(-3.0e38);
        }
    }
    sync_cube();
    // Top-k by choice, ties to the lower index; taken ones are marked below even the masked
    // ones (k never exceeds the kept experts, checked at launch).
    for j in 0..top_k as usize {
        // This unit's best (ascending scan, strict: the lowest index among equals).
        let mut best = f32::new(-3.0e38);
        let mut best_e = 0u32;
        for e in range_stepped(unit, e_count, UNITS as usize) {
            if choice[e] > best {
                best = choice[e];
                best_e = e as u32;
            }
        }
        best_value[unit] = best;
        best_index[unit] = best_e;
        sync_cube();
        let levels = comptime!(UNITS.trailing_zeros());
        for level in 0..levels {
            let half = (UNITS as usize) >> (level + 1) as usize;
            if unit < half {
                let (v, i) = (best_value[unit + half], best_index[unit + half]);
                let (w, k) = (best_value[unit], best_index[unit]);
                if v > w || (v == w && i < k) {
                    best_value[unit] = v;
                    best_index[unit] = i;
                }
            }
            sync_cube();
        }
        if unit == 0 {
            let e = best_index[0];
            choice[e as usize] = f32::new(-3.4e38);
            picked[j] = e;
        }
        sync_cube();
    }
    if unit == 0 {
        let mut sum = 0.0f32;
        for j in 0..top_k as usize {
            sum += scores[picked[j] as usize];
        }
        let denom = select(norm == 1, sum + 1e-20, 1.0);
        for j in 0..top_k as usize {
            let e = picked[j];
            experts_out[t * top_k as usize + j] = e;
            weights_out[t * top_k as usize + j] = scores[e as usize] / denom * scaling;
        }
    }
}

/// Routes `tokens` tokens given their router logits `[tokens, n_routed_experts]` (f32).
pub fn route<R: Runtime>(
    client: &ComputeClient<R>,
    logits: &DeviceArray<f32>,
    bias: &DeviceArray<f32>,
    tokens: usize,
    params: &GateParams,
    out: &Routing,
) -> Result<(), KernelError> {
    let p = params;
    let e = p.n_routed_experts;
    if e == 0 || e > MAX_EXPERTS {
        return Err(KernelError::Range {
            what: "n_routed_experts",
            value: e,
            min: 1,
            max: MAX_EXPERTS,
        });
    }
    if p.n_group == 0 || p.n_group > MAX_GROUPS || !e.is_multiple_of(p.n_group) || e / p.n_group < 2
    {
        return Err(KernelError::Range {
            what: "n_group (divides experts, >= 2 per group)",
            value: p.n_group,
            min: 1,
            max: MAX_GROUPS,
        });
    }
    if p.topk_group == 0 || p.topk_group > p.n_group {
        return Err(KernelError::Range {
            what: "topk_group",
            value: p.topk_group,
            min: 1,
            max: p.n_group,
        });
    }
    let max_k = MAX_TOP_K.min(e / p.n_group * p.topk_group);
    if p.num_experts_per_tok == 0 || p.num_experts_per_tok > max_k {
        return Err(KernelError::Range {
            what: "num_experts_per_tok",
            value: p.num_experts_per_tok,
            min: 1,
            max: max_k,
        });
    }
    check_len("router logits", logits, tokens * e)?;
    check_len("correction bias", bias, e)?;
    check_len(
        "routed experts",
        &out.experts,
        tokens * p.num_experts_per_tok,
    )?;
    check_len(
        "routing weights",
        &out.weights,
        tokens * p.num_experts_per_tok,
    )?;
    if tokens == 0 {
        return Ok(());
    }
    // SAFETY: shapes validated above.
    unsafe {
        route_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(tokens as u32, 1, 1),
            CubeDim::new_1d(UNITS),
            logits.arg(),
            bias.arg(),
            out.experts.arg(),
            out.weights.arg(),
            e as u32,
            p.num_experts_per_tok as u32,
            p.n_group as u32,
            p.topk_group as u32,
            p.norm_topk_prob as u32,
            p.routed_scaling_factor,
        )
    }
    Ok(())
}
