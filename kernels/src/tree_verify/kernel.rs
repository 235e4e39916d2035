//! The cube kernels: greedy, one cube per request; stochastic, one or more (below).
//!
//! The stochastic kernel streams a whole vocabulary row only when a rejection needs a new
//! residual (and once more for the bonus when the walk ends on a node without rejections),
//! so its bytes are the rows the walk must read. Its design:
//! - The residual is never stored: after `k` rejections at a node it is `w_k / S_k`, with
//!   `w_0 = p`, `S_0 = 1`, `w_{j+1} = relu(w_j - S_j q)` and `S_{j+1} = sum(w_{j+1})`
//!   (algebraically the reference's `norm(relu(r - q))`). As `q >= 0` and every `S_j > 0`,
//!   `w_k = relu(p - T_k q)` with `T_k = S_0 + ... + S_{k-1}`: one scalar, so a pass
//!   recomputes `w_k` from the target and draft rows with one multiply-add per token: no
//!   scratch buffer, no writes, and one read of `p` and `q` per rejection instead of
//!   read-write-reread.
//! - A pass is coalesced and vectorised: the cube's units form groups of 32 (a CUDA plane),
//!   each group streams one contiguous segment of the row in 4-float vectors, with
//!   [`UNROLL`] loads per array in flight per unit. The walk's scalar reads (each child's
//!   `p(x)`, `q(x)` and uniform) are fetched for all nodes at once before it starts.
//! - The bonus is sampled by inverse CDF in three levels, so the row is not read twice: the
//!   segment from the sums the last pass left in shared memory, then a unit's span of that
//!   segment (the segment re-read: 1/16 of the row at 512 units), then the token.
//! - Reductions go through shared memory only (llvmpipe has no plane operations).
//!
//! - Several cubes per request where the device lets them all run at once (the launcher's
//!   choice, [`super::verify_stochastic_split`]): each takes one contiguous share of every
//!   row, all walk the same tree, and after each pass they trade their share's sum through
//!   `exchange` (one atomic word per cube and pass, empty until written), so every cube
//!   adds the same sums in the same order and takes the same decisions. The cube whose
//!   share holds the bonus's mass samples it. The last cube out empties the words again.
//!   A cube waits for the others' words, so this is only safe when all cubes are resident
//!   together; with one cube per request nothing waits.
use cubecl::prelude::*;

use super::{MAX_NODES, MAX_SPLIT};

/// An exchange word no cube has written (a NaN no pass stores: a sum that is this NaN is
/// stored as the canonical one).
pub(super) const EMPTY: u32 = 0xffff_ffff;

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

/// Units per group: a group streams one contiguous segment of a row.
const GROUP: usize = 32;
/// Vectors per array each unit loads before using any.
const UNROLL: usize = 4;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn verify_stochastic_kernel<N: Size>(
    parents: &Array<i32>,
    tokens: &Array<u32>,
    target_probs: &Array<f32>,
    draft_probs: &Array<f32>,
    target_vectors: &Array<Vector<f32, N>>,
    draft_vectors: &Array<Vector<f32, N>>,
    uniforms: &Array<f32>,
    accepted: &mut Array<i32>,
    accept_len: &mut Array<u32>,
    bonus: &mut Array<u32>,
    exchange: &mut Array<Atomic<u32>>,
    nodes: u32,
    vocab: u32,
    cubes: u32,
    #[comptime] units: u32,
) {
    let split = cubes as usize;
    let b = CUBE_POS_X as usize / split;
    let part = CUBE_POS_X as usize % split;
    let unit = UNIT_POS_X as usize;
    let n = nodes as usize;
    let v = vocab as usize;
    let base = b * n;
    let width = N::value();
    // This cube's share of every row, in vectors.
    let lines = v / width;
    let share = lines.div_ceil(split);
    let lo = min(part * share, lines);
    let hi = min(lo + share, lines);
    // The request's exchange words (after one counter per request): one per pass and cube,
    // each pass taking the next `split`.
    let batch = CUBE_COUNT_X as usize / split;
    let mut words = batch + base * split;
    let mut cube_sums = SharedMemory::<f32>::new(MAX_SPLIT);
    let mut last_out = SharedMemory::<u32>::new(1usize);
    let mut partials = SharedMemory::<f32>::new(units as usize);
    let mut spans = SharedMemory::<f32>::new(units as usize);
    let mut group_sums = SharedMemory::<f32>::new(units as usize / GROUP);
    // Node c's parent, uniform, and its token's target and draft probabilities at the
    // parent: all the walk's scalar reads, fetched at once rather than one node at a time.
    let mut parent_of = SharedMemory::<u32>::new(MAX_NODES);
    let mut child_u = SharedMemory::<f32>::new(MAX_NODES);
    let mut child_p = SharedMemory::<f32>::new(MAX_NODES);
    let mut child_q = SharedMemory::<f32>::new(MAX_NODES);
    for c in range_stepped(unit + 1, n, units as usize) {
        let parent = parents[base + c] as usize;
        let at = (base + parent) * v + tokens[base + c] as usize;
        parent_of[c] = parent as u32;
        child_u[c] = uniforms[b * (n + 1) + c];
        child_p[c] = target_probs[at];
        child_q[c] = draft_probs[at];
    }
    sync_cube();

    // Every unit walks the same path: all decisions come from shared memory read after a
    // barrier.
    let mut cur = 0usize;
    let mut len = 0usize;
    // The current residual is relu(p - shift * q) / total.
    let mut shift = 0.0f32;
    let mut total = 1.0f32;
    // Whether group_sums and cube_sums hold the sums of the current residual.
    let mut sums_ready = false;
    for c in 1..n {
        if parent_of[c] as usize == cur {
            let q_x = child_q[c];
            let w_x = residual_at(child_p[c], q_x, shift);
            if child_u[c] * q_x < w_x / total {
                if unit == 0 && part == 0 {
                    accepted[base + len] = c as i32;
                }
                len += 1;
                cur = c;
                shift = 0.0;
                total = 1.0;
                sums_ready = false;
            } else {
                let shifted = shift + total;
                let row = (base + cur) * v;
                let own = row_pass(
                    target_vectors,
                    draft_vectors,
                    row / width + lo,
                    hi - lo,
                    shifted,
                    &mut partials,
                    &mut group_sums,
                    unit,
                    units,
                );
                let next = share_sums(own, exchange, words, split, part, &mut cube_sums, unit);
                words += split;
                // A zero sum means r <= q everywhere with equal sums, so r == q: keep r
                // (the reference's rule).
                sums_ready = next > 0.0;
                if sums_ready {
                    shift = shifted;
                    total = next;
                }
            }
        }
    }

    let row = (base + cur) * v;
    if !sums_ready {
        let own = row_pass(
            target_vectors,
            draft_vectors,
            row / width + lo,
            hi - lo,
            shift,
            &mut partials,
            &mut group_sums,
            unit,
            units,
        );
        total = share_sums(own, exchange, words, split, part, &mut cube_sums, unit);
        words += split;
    }
    // The cube whose share holds the mass samples the bonus (the same rule as within a
    // share: the first whose running sum exceeds it, else the last with any).
    let mass = uniforms[b * (n + 1) + n] * total;
    let owner = pick(&cube_sums, 0, split, mass);
    if part == owner {
        let picked = sample(
            target_vectors,
            draft_vectors,
            target_probs,
            draft_probs,
            row + lo * width,
            hi - lo,
            mass - prefix(&cube_sums, 0, owner),
            shift,
            &mut partials,
            &mut spans,
            &mut group_sums,
            unit,
            units,
        );
        if unit == 0 {
            bonus[b] = (lo * width + picked) as u32;
        }
    }
    if unit == 0 && part == 0 {
        for i in len..n {
            accepted[base + i] = -1;
        }
        accept_len[b] = len as u32;
    }
    if split > 1 {
        // Every cube has read all the words it waits on; the last one out empties the
        // request's words (and its counter, after them) for the next launch.
        if unit == 0 {
            let before = exchange[b].fetch_add(1);
            last_out[0] = select(before == cubes - 1, 1u32, 0u32);
        }
        sync_cube();
        if last_out[0] == 1 {
            for i in range_stepped(batch + base * split + unit, words, units as usize) {
                exchange[i].store(EMPTY);
            }
            if unit == 0 {
                exchange[b].store(0);
            }
        }
    }
}

/// The row's sum over every cube's share, the same in every cube: with one cube its own;
/// otherwise each cube stores its share's sum in its word of `words..words + split` and
/// reads the others' as they arrive. Leaves the shares' sums in `cube_sums`; ends with a
/// barrier.
#[cube]
#[allow(clippy::too_many_arguments)]
fn share_sums(
    own: f32,
    exchange: &mut Array<Atomic<u32>>,
    words: usize,
    split: usize,
    part: usize,
    cube_sums: &mut SharedMemory<f32>,
    unit: usize,
) -> f32 {
    if split == 1 {
        if unit == 0 {
            cube_sums[0] = own;
        }
    } else {
        if unit == 0 {
            let bits = u32::reinterpret(own);
            exchange[words + part].store(select(bits == EMPTY, 0x7fc0_0000u32, bits));
        }
        if unit < split {
            let mut bits = exchange[words + unit].load();
            while bits == EMPTY {
                bits = exchange[words + unit].load();
            }
            cube_sums[unit] = f32::reinterpret(bits);
        }
    }
    sync_cube();
    let mut total = 0.0f32;
    for i in 0..split {
        total += cube_sums[i];
    }
    total
}

/// The unnormalized residual `relu(p - shift * q)` at one token.
#[cube]
fn residual_at(p: f32, q: f32, shift: f32) -> f32 {
    max(p - shift * q, 0.0)
}

/// One coalesced pass over a row (`lines` vectors from vector `row`): each group sums one
/// contiguous segment, its lanes reading consecutive vectors. Returns the sum of the residual
/// and leaves the segment sums in `group_sums`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn row_pass<N: Size>(
    target: &Array<Vector<f32, N>>,
    draft: &Array<Vector<f32, N>>,
    row: usize,
    lines: usize,
    shift: f32,
    partials: &mut SharedMemory<f32>,
    group_sums: &mut SharedMemory<f32>,
    unit: usize,
    #[comptime] units: u32,
) -> f32 {
    let groups = comptime!(units as usize / GROUP);
    let per_group = lines.div_ceil(groups);
    let start = min(unit / GROUP * per_group, lines);
    let end = min(start + per_group, lines);
    let sum = vector_sum(target, draft, row, start + unit % GROUP, end, GROUP, shift);
    group_reduce(sum, partials, group_sums, unit);
    let mut total = 0.0f32;
    for g in 0..groups {
        total += group_sums[g];
    }
    total
}

/// Sum of `relu(p - shift * q)` over vectors `first, first + step, ...` below `end` of the row at
/// vector `row`, with [`UNROLL`] loads per array issued before any is used. Reads the draft
/// row only when `shift > 0`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn vector_sum<N: Size>(
    target: &Array<Vector<f32, N>>,
    draft: &Array<Vector<f32, N>>,
    row: usize,
    first: usize,
    end: usize,
    step: usize,
    shift: f32,
) -> f32 {
    let zero = Vector::<f32, N>::new(0.0);
    let mut acc = zero;
    let mut p = Array::<Vector<f32, N>>::new(UNROLL);
    let mut q = Array::<Vector<f32, N>>::new(UNROLL);
    for i in range_stepped(first, end, step * UNROLL) {
        // Indices past `end` re-read the last vector and are masked below.
        #[unroll]
        for r in 0..UNROLL {
            let at = row + min(i + r * step, end - 1);
            p[r] = target[at];
            if shift > 0.0 {
                q[r] = draft[at];
            }
        }
        #[unroll]
        for r in 0..UNROLL {
            let mut w = p[r];
            if shift > 0.0 {
                w = max(w - q[r] * Vector::new(shift), zero);
            }
            acc += select(i + r * step < end, w, zero);
        }
    }
    let mut sum = 0.0f32;
    #[unroll]
    for e in 0..N::value() {
        sum += acc[e];
    }
    sum
}

/// Sums `value` over each group of [`GROUP`] units into `group_sums[group]` (a tree in
/// shared memory); ends with a barrier.
#[cube]
fn group_reduce(
    value: f32,
    partials: &mut SharedMemory<f32>,
    group_sums: &mut SharedMemory<f32>,
    unit: usize,
) {
    let lane = unit % GROUP;
    partials[unit] = value;
    sync_cube();
    #[unroll]
    for level in 0..comptime!(GROUP.trailing_zeros()) {
        let stride = comptime!(GROUP >> (level + 1));
        if lane < stride {
            partials[unit] += partials[unit + stride];
        }
        sync_cube();
    }
    if lane == 0 {
        group_sums[unit / GROUP] = partials[unit];
    }
    sync_cube();
}

/// Inverse-CDF choice among `count` sums from `sums[start]`: the first index where the
/// running sum exceeds `mass`, else (rounding) the last one with mass, else the last one.
#[cube]
fn pick(sums: &SharedMemory<f32>, start: usize, count: usize, mass: f32) -> usize {
    let mut running = 0.0f32;
    let mut picked = count;
    let mut last_positive = count - 1;
    for i in 0..count {
        let s = sums[start + i];
        if picked == count {
            running += s;
            if running > mass {
                picked = i;
            }
        }
        if s > 0.0 {
            last_positive = i;
        }
    }
    select(picked < count, picked, last_positive)
}

/// Sum of `sums[start..start + count]`.
#[cube]
fn prefix(sums: &SharedMemory<f32>, start: usize, count: usize) -> f32 {
    let mut s = 0.0f32;
    for i in 0..count {
        s += sums[start + i];
    }
    s
}

/// Samples the token where the cumulative sum of `relu(p - shift * q)` over the row (element `row`,
/// vector `row / width`) first exceeds `mass`, in three levels: the segment, from the sums
/// [`row_pass`] left in `group_sums`; a unit's span of the segment, from every unit's span
/// sum (contiguous spans, read with [`vector_sum`]); the token, by a scalar scan of that span
/// (in the L1 of the cube that just read it).
#[cube]
#[allow(clippy::too_many_arguments)]
fn sample<N: Size>(
    target_vectors: &Array<Vector<f32, N>>,
    draft_vectors: &Array<Vector<f32, N>>,
    target: &Array<f32>,
    draft: &Array<f32>,
    row: usize,
    lines: usize,
    mass: f32,
    shift: f32,
    partials: &mut SharedMemory<f32>,
    spans: &mut SharedMemory<f32>,
    group_sums: &mut SharedMemory<f32>,
    unit: usize,
    #[comptime] units: u32,
) -> usize {
    let width = N::value();
    let per_group = lines.div_ceil(comptime!(units as usize / GROUP));
    // The segment, among those holding any vector.
    let seg = pick(group_sums, 0, lines.div_ceil(per_group), mass);
    let mut rest = mass - prefix(group_sums, 0, seg);
    let lo = seg * per_group;
    let hi = min(lo + per_group, lines);
    // Every unit read group_sums above, before group_reduce's first barrier rewrites them.
    let span = (hi - lo).div_ceil(units as usize);
    let used = (hi - lo).div_ceil(span);
    let first = min(lo + unit * span, hi);
    let sum = vector_sum(
        target_vectors,
        draft_vectors,
        row / width,
        first,
        min(first + span, hi),
        1,
        shift,
    );
    spans[unit] = sum;
    group_reduce(sum, partials, group_sums, unit);
    let group = pick(group_sums, 0, used.div_ceil(GROUP), rest);
    rest -= prefix(group_sums, 0, group);
    let chosen = group * GROUP + pick(spans, group * GROUP, min(GROUP, used - group * GROUP), rest);
    rest -= prefix(spans, group * GROUP, chosen - group * GROUP);
    // The token within the chosen span, by the same rule.
    let from = (lo + chosen * span) * width;
    let to = min(lo + (chosen + 1) * span, hi) * width;
    let mut running = 0.0f32;
    let mut picked = to;
    let mut last_positive = to - 1;
    for t in from..to {
        let w = residual_at(target[row + t], draft[row + t], shift);
        if picked == to {
            running += w;
            if running > rest {
                picked = t;
            }
        }
        if w > 0.0 {
            last_positive = t;
        }
    }
    select(picked < to, picked, last_positive)
}
