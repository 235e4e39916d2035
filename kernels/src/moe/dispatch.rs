//! Grouping (token, choice) pairs by expert for the grouped GEMM: a stable counting sort on
//! the device. Pair `a = t * k + j` (token `t`'s `j`-th expert) lands at sorted row
//! `slot[a]`; rows `offsets[e]..offsets[e + 1]` belong to expert `e`, in token order;
//! `source[r]` is the token whose activations feed sorted row `r`.
//!
//! Up to [`ONE_CUBE_MAX_PAIRS`] pairs (decode: 128 tokens x top-8) one cube sorts: each unit
//! counts and then places the pairs of its own experts (a unit per expert, strided), unit 0
//! turns counts into offsets; one launch. Past that, each unit's walks over every pair grow
//! with the batch (7.9 ms for an 8k-token prefill on the H200, `benches/RESULTS.md`), so a
//! cube per expert sorts instead: one launch counts the expert's pairs, a second sums the
//! counts of the experts before it (its offset), splits the pairs into one contiguous segment
//! per unit, scans the units' counts and places each unit's pairs in pair order.
use cubecl::prelude::*;

use super::gate::MAX_EXPERTS;
use crate::buffer::check_len;
use crate::reduce::cube_sum;
use crate::{DeviceArray, KernelError};

const UNITS: u32 = 256;
/// The most pairs the one-cube sort takes.
pub const ONE_CUBE_MAX_PAIRS: usize = 1024;

/// The sort's outputs.
pub struct Dispatch {
    /// `experts + 1` row offsets of each expert's block.
    pub offsets: DeviceArray<u32>,
    /// Sorted row of each (token, choice) pair, `[tokens * k]`.
    pub slot: DeviceArray<u32>,
    /// Token feeding each sorted row, `[tokens * k]`.
    pub source: DeviceArray<u32>,
}

#[cube(launch_unchecked)]
fn dispatch_kernel(
    experts: &Array<u32>,
    offsets: &mut Array<u32>,
    slot: &mut Array<u32>,
    source: &mut Array<u32>,
    n_experts: u32,
    top_k: u32,
) {
    let unit = UNIT_POS_X as usize;
    let pairs = experts.len();
    let mut counts = SharedMemory::<u32>::new(MAX_EXPERTS + 1);
    for e in range_stepped(unit, n_experts as usize, UNITS as usize) {
        let mut c = 0u32;
        for a in 0..pairs {
            if experts[a] == e as u32 {
                c += 1;
            }
        }
        counts[e] = c;
    }
    sync_cube();
    if unit == 0 {
        let mut running = 0u32;
        for e in 0..n_experts as usize {
            let c = counts[e];
            counts[e] = running;
            offsets[e] = running;
            running += c;
        }
        offsets[n_experts as usize] = running;
    }
    sync_cube();
    for e in range_stepped(unit, n_experts as usize, UNITS as usize) {
        let mut next = counts[e];
        for a in 0..pairs {
            if experts[a] == e as u32 {
                slot[a] = next;
                source[next as usize] = a as u32 / top_k;
                next += 1;
            }
        }
    }
}

/// Cube `e` counts the pairs routed to expert `e`.
#[cube(launch_unchecked)]
fn count_kernel(experts: &Array<u32>, counts: &mut Array<u32>) {
    let e = CUBE_POS_X;
    let unit = UNIT_POS_X as usize;
    let mut partials = SharedMemory::<u32>::new(UNITS as usize);
    let mut c = 0u32;
    for a in range_stepped(unit, experts.len(), UNITS as usize) {
        if experts[a] == e {
            c += 1;
        }
    }
    let total = cube_sum(c, &mut partials, unit, UNITS);
    if unit == 0 {
        counts[e as usize] = total;
    }
}

/// Cube `e` places expert `e`'s pairs: its offset is the sum of the counts before it; unit
/// `u` walks the `u`-th contiguous segment of the pairs, once to count and, after a scan of
/// the counts over the units, once to place.
#[cube(launch_unchecked)]
fn place_kernel(
    experts: &Array<u32>,
    counts: &Array<u32>,
    offsets: &mut Array<u32>,
    slot: &mut Array<u32>,
    source: &mut Array<u32>,
    top_k: u32,
) {
    let e = CUBE_POS_X as usize;
    let unit = UNIT_POS_X as usize;
    let pairs = experts.len();
    let mut partials = SharedMemory::<u32>::new(UNITS as usize);
    let mut before = 0u32;
    for x in range_stepped(unit, e, UNITS as usize) {
        before += counts[x];
    }
    let offset = cube_sum(before, &mut partials, unit, UNITS);
    if unit == 0 {
        offsets[e] = offset;
        if e + 1 == CUBE_COUNT_X as usize {
            offsets[e + 1] = offset + counts[e];
        }
    }
    let segment = pairs.div_ceil(UNITS as usize);
    let lo = min(unit * segment, pairs);
    let hi = min(lo + segment, pairs);
    let mut mine = 0u32;
    for a in lo..hi {
        if experts[a] == e as u32 {
            mine += 1;
        }
    }
    // Inclusive scan of the units' counts (Hillis-Steele).
    let mut scan = SharedMemory::<u32>::new(UNITS as usize);
    scan[unit] = mine;
    sync_cube();
    let levels = comptime!(UNITS.trailing_zeros());
    for level in 0..levels {
        let d = 1usize << level as usize;
        let mut add = 0u32;
        if unit >= d {
            add = scan[unit - d];
        }
        sync_cube();
        scan[unit] += add;
        sync_cube();
    }
    let mut next = offset + scan[unit] - mine;
    for a in lo..hi {
        if experts[a] == e as u32 {
            slot[a] = next;
            source[next as usize] = a as u32 / top_k;
            next += 1;
        }
    }
}

/// Sorts the `tokens * k` routed pairs in `experts` by expert.
pub fn dispatch<R: Runtime>(
    client: &ComputeClient<R>,
    experts: &DeviceArray<u32>,
    n_experts: usize,
    top_k: usize,
    out: &Dispatch,
) -> Result<(), KernelError> {
    if n_experts == 0 || n_experts > MAX_EXPERTS {
        return Err(KernelError::Range {
            what: "experts",
            value: n_experts,
            min: 1,
            max: MAX_EXPERTS,
        });
    }
    if top_k == 0 || !experts.len().is_multiple_of(top_k) {
        return Err(KernelError::Alignment {
            what: "routed pairs",
            value: experts.len(),
            multiple: top_k.max(1),
        });
    }
    check_len("expert offsets", &out.offsets, n_experts + 1)?;
    check_len("slots", &out.slot, experts.len())?;
    check_len("sources", &out.source, experts.len())?;
    if experts.is_empty() {
        return Ok(());
    }
    // SAFETY: shapes validated; expert ids are trusted to be below `n_experts` (the router
    // writes them).
    unsafe {
        if experts.len() <= ONE_CUBE_MAX_PAIRS {
            dispatch_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(UNITS),
                experts.arg(),
                out.offsets.arg(),
                out.slot.arg(),
                out.source.arg(),
                n_experts as u32,
                top_k as u32,
            );
        } else {
            let counts = DeviceArray::<u32>::uninit(client, n_experts);
            count_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(n_experts as u32, 1, 1),
                CubeDim::new_1d(UNITS),
                experts.arg(),
                counts.arg(),
            );
            place_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(n_experts as u32, 1, 1),
                CubeDim::new_1d(UNITS),
                experts.arg(),
                counts.arg(),
                out.offsets.arg(),
                out.slot.arg(),
                out.source.arg(),
                top_k as u32,
            );
        }
    }
    Ok(())
}

#[cube(launch_unchecked)]
fn gather_kernel<E: CubePrimitive>(
    x: &Array<E>,
    source: &Array<u32>,
    out: &mut Array<E>,
    cols: u32,
) {
    let r = CUBE_POS_X as usize;
    let c = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let n = cols as usize;
    if c < n {
        out[r * n + c] = x[source[r] as usize * n + c];
    }
}

/// Checks a row copy between `whole` (any number of rows of `cols`) and `picked` (a row per
/// index) and returns its grid: a cube per index, `None` when there are none.
fn row_grid<R: Runtime, E>(
    client: &ComputeClient<R>,
    (whole_what, whole): (&'static str, &DeviceArray<E>),
    (picked_what, picked): (&'static str, &DeviceArray<E>),
    indices: &DeviceArray<u32>,
    cols: usize,
) -> Result<Option<CubeCount>, KernelError> {
    if cols == 0 || !whole.len().is_multiple_of(cols) {
        return Err(KernelError::Alignment {
            what: whole_what,
            value: whole.len(),
            multiple: cols.max(1),
        });
    }
    check_len(picked_what, picked, indices.len() * cols)?;
    let max = client.properties().hardware.max_cube_count.0 as usize;
    if indices.len() > max {
        return Err(KernelError::Range {
            what: picked_what,
            value: indices.len(),
            min: 0,
            max,
        });
    }
    let rows = indices.len() as u32;
    Ok((rows > 0).then(|| CubeCount::Static(rows, (cols as u32).div_ceil(UNITS), 1)))
}

/// `out[r, :] = x[source[r], :]` for rows of `cols` values of any element type (f32
/// activations; u32 words of KV pages, `mla::gather_pages`).
pub fn gather_rows<R: Runtime, E: CubePrimitive + CubeElement>(
    client: &ComputeClient<R>,
    x: &DeviceArray<E>,
    cols: usize,
    source: &DeviceArray<u32>,
    out: &DeviceArray<E>,
) -> Result<(), KernelError> {
    let Some(count) = row_grid(
        client,
        ("rows of x", x),
        ("gathered rows", out),
        source,
        cols,
    )?
    else {
        return Ok(());
    };
    // SAFETY: shapes validated; sources are trusted to index rows of `x`.
    unsafe {
        gather_kernel::launch_unchecked::<E, R>(
            client,
            count,
            CubeDim::new_1d(UNITS),
            x.arg(),
            source.arg(),
            out.arg(),
            cols as u32,
        )
    }
    Ok(())
}

#[cube(launch_unchecked)]
fn scatter_kernel<E: CubePrimitive>(
    x: &Array<E>,
    dest: &Array<u32>,
    out: &mut Array<E>,
    cols: u32,
) {
    let r = CUBE_POS_X as usize;
    let c = (CUBE_POS_Y * CUBE_DIM_X + UNIT_POS_X) as usize;
    let n = cols as usize;
    if c < n {
        let row = dest[r] as usize;
        out[row * n + c] = x[r * n + c];
    }
}

/// `out[dest[r], :] = x[r, :]`, the inverse of [`gather_rows`] (rows of `out` that no
/// `dest` names keep their values; `dest` must not repeat a row).
pub fn scatter_rows<R: Runtime, E: CubePrimitive + CubeElement>(
    client: &ComputeClient<R>,
    x: &DeviceArray<E>,
    cols: usize,
    dest: &DeviceArray<u32>,
    out: &DeviceArray<E>,
) -> Result<(), KernelError> {
    let Some(count) = row_grid(
        client,
        ("rows of out", out),
        ("scattered rows", x),
        dest,
        cols,
    )?
    else {
        return Ok(());
    };
    // SAFETY: shapes validated; destinations are trusted to index rows of `out`.
    unsafe {
        scatter_kernel::launch_unchecked::<E, R>(
            client,
            count,
            CubeDim::new_1d(UNITS),
            x.arg(),
            dest.arg(),
            out.arg(),
            cols as u32,
        )
    }
    Ok(())
}
