//! The cube kernels: one cube per request.
use cubecl::prelude::*;

use crate::reduce::cube_sum;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn verify_greedy_kernel(
    parents: &Array<i32>,
    tokens: &Array<u32>,
    target_argmax: &Array<u32>,
    accepted: &mut Array<i32>,
    accept_len: &mut Array<u32>,
    bonus: &mut Array<u32>,
    nodes: u32,
    #[comptime] units: u32,
) {
    let b = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let n = nodes as usize;
    let base = b * n;
    // matched[i]: node i's token is the target's choice at its parent.
    let mut matched = SharedMemory::<u32>::new(units as usize);
    if unit < n {
        let mut hit = 0u32;
        if unit > 0 {
            let parent = parents[base + unit] as usize;
            if tokens[base + unit] == target_argmax[base + parent] {
                hit = 1;
            }
        }
        matched[unit] = hit;
    }
    sync_cube();
    if unit == 0 {
        // Children have larger indices than their parent, so one ascending pass finds the
        // lowest-index matching child of the current node, then of that child, and so on.
        let mut cur = 0usize;
        let mut len = 0usize;
        for c in 1..n {
            if matched[c] == 1 && parents[base + c] as usize == cur {
                accepted[base + len] = c as i32;
                len += 1;
                cur = c;
            }
        }
        // The rest of the row is padding (written by the same unit as the path, so no
        // ordering across units is needed).
        for i in len..n {
            accepted[base + i] = -1;
        }
        accept_len[b] = len as u32;
        bonus[b] = target_argmax[base + cur];
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn verify_stochastic_kernel(
    parents: &Array<i32>,
    tokens: &Array<u32>,
    target_probs: &Array<f32>,
    draft_probs: &Array<f32>,
    uniforms: &Array<f32>,
    residual: &mut Array<f32>,
    accepted: &mut Array<i32>,
    accept_len: &mut Array<u32>,
    bonus: &mut Array<u32>,
    nodes: u32,
    vocab: u32,
    #[comptime] units: u32,
) {
    let b = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let n = nodes as usize;
    let v = vocab as usize;
    let base = b * n;
    let res = b * v;
    let mut partials = SharedMemory::<f32>::new(units as usize);

    let mut cur = 0usize;
    let mut len = 0usize;
    // While true the residual is the target row of `cur` itself, not yet copied.
    let mut fresh = true;
    for c in 1..n {
        if parents[base + c] as usize == cur {
            let x = tokens[base + c] as usize;
            let q_row = (base + cur) * v;
            let r_x = select(fresh, target_probs[q_row + x], residual[res + x]);
            if uniforms[b * (n + 1) + c] * draft_probs[q_row + x] < r_x {
                if unit == 0 {
                    accepted[base + len] = c as i32;
                }
                len += 1;
                cur = c;
                fresh = true;
            } else {
                // r = relu(r - q), then renormalise.
                let mut partial = 0.0f32;
                for t in range_stepped(unit, v, units as usize) {
                    let r = select(fresh, target_probs[q_row + t], residual[res + t]);
                    let next = max(r - draft_probs[q_row + t], 0.0);
                    residual[res + t] = next;
                    partial += next;
                }
                let total = cube_sum(partial, &mut partials, unit, units);
                // total == 0 means r <= q everywhere with equal sums, so r == q: keep r.
                for t in range_stepped(unit, v, units as usize) {
                    residual[res + t] = select(
                        total > 0.0,
                        residual[res + t] / total,
                        draft_probs[q_row + t],
                    );
                }
                // Every unit reads any residual entry next: order the global writes
                // (workgroupBarrier alone does not on wgpu).
                sync_storage();
                fresh = false;
            }
        }
    }

    // Sample the bonus token from r by inverse CDF: each unit sums a contiguous span.
    let row = (base + cur) * v;
    let span = v.div_ceil(units as usize);
    let start = min(unit * span, v);
    let end = min(start + span, v);
    let mut partial = 0.0f32;
    for t in start..end {
        partial += select(fresh, target_probs[row + t], residual[res + t]);
    }
    partials[unit] = partial;
    sync_cube();
    if unit == 0 {
        let mut total = 0.0f32;
        for s in 0..units as usize {
            total += partials[s];
        }
        let target = uniforms[b * (n + 1) + n] * total;
        let mut picked = v;
        let mut last_positive = 0usize;
        let mut running = 0.0f32;
        for s in 0..units as usize {
            if picked == v {
                if running + partials[s] > target {
                    let s_end = min(s * span + span, v);
                    for t in s * span..s_end {
                        let p = select(fresh, target_probs[row + t], residual[res + t]);
                        if picked == v {
                            running += p;
                            if running > target {
                                picked = t;
                            }
                        }
                    }
                } else {
                    running += partials[s];
                }
            }
        }
        if picked == v {
            // Rounding left the target at the very end: take the last token with mass.
            for t in 0..v {
                if select(fresh, target_probs[row + t], residual[res + t]) > 0.0 {
                    last_positive = t;
                }
            }
            picked = last_positive;
        }
        for i in len..n {
            accepted[base + i] = -1;
        }
        accept_len[b] = len as u32;
        bonus[b] = picked as u32;
    }
}
