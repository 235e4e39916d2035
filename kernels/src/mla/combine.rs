//! Merges the partial results of a split-KV attention launch (`mma.rs`, `wide.rs`): each
//! split wrote its rows' unnormalised sums and (max, sum); the output is their
//! softmax-weighted combination.
use cubecl::prelude::*;

use super::mma::NEG_BIG;

/// Units of a combine cube: `lanes` split lanes (2, 4, 8 or 32) x `256 / lanes` vectors of 4
/// dimensions.
pub const COMBINE_UNITS: u32 = 256;
/// Most splits a launch may have: 4 per unit in the combine's first pass.
pub const MAX_SPLITS: usize = 1024;
/// Splits per lane whose sums are loaded together.
const LOADS: usize = 4;

/// Split lanes of a combine of `splits` splits over `rows` query rows: 32 (cubes of 32
/// dimensions) while the launch stays within a few cubes per SM; past 64 rows as few as
/// load each lane's splits in one round of [`LOADS`], from 2 (a cube covers a row's 512
/// dimensions) to 8 (cubes of 128 dimensions), so a batch's rows fit in few waves and no
/// lane idles (64 heads x 32 tokens over 4 splits: 8 lanes took 26 us on the H200, 8192
/// cubes whose lanes were mostly empty).
pub fn combine_lanes(rows: usize, splits: usize) -> u32 {
    if rows <= 64 {
        return 32;
    }
    match splits.div_ceil(LOADS) {
        0..=2 => 2,
        3..=4 => 4,
        _ => 8,
    }
}

/// Merges the splits of one query row: `out = sum_s e^{m_s - M} O_s / sum_s e^{m_s - M} l_s`
/// over the splits that saw any position (`l_s > 0`). A cube per (row, `1024 / lanes`
/// dimensions).
///
/// Every load is independent of the ones before, so each unit has several in flight (a
/// loop that folds each split into running values before loading the next waits one L2
/// round trip per split): unit `u` loads the 4 dimensions `u % (256 / lanes)` of
/// [`LOADS`] of its splits `s = u / (256 / lanes) (mod lanes)` first, then all units read
/// the splits' `(m, l)`, 4 each, and leave the weights `e^{m_s - M}` in shared memory;
/// then each round adds the loaded sums while the next round's are loaded.
#[cube(launch_unchecked)]
pub fn combine_kernel(
    part_out: &Array<Vector<f32, Const<4>>>,
    part_ml: &Array<f32>,
    out: &mut Array<Vector<f32, Const<4>>>,
    total_rows: u32,
    splits: u32,
    #[comptime] lanes: u32,
) {
    let row = CUBE_POS_X as usize;
    let block = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let units = comptime!(COMBINE_UNITS as usize);
    let lanes = comptime!(lanes as usize);
    let vecs = comptime!(units / lanes);
    let total = total_rows as usize;
    let n = splits as usize;
    let mut weights = SharedMemory::<f32>::new(MAX_SPLITS);
    let mut warp_maxes = SharedMemory::<f32>::new(8usize);
    let mut warp_dens = SharedMemory::<f32>::new(8usize);
    let mut sums = SharedMemory::<Vector<f32, Const<4>>>::new(units);

    // 1. The first round of this unit's sums in flight.
    let lane = unit / vecs;
    let vec = block * vecs + unit % vecs;
    let mut v = Array::<Vector<f32, Const<4>>>::new(LOADS);
    #[unroll]
    for k in 0..LOADS {
        let s = lane + k * lanes;
        v[k] = Vector::new(0.0);
        if s < n {
            v[k] = part_out[(s * total + row) * 128 + vec];
        }
    }

    // 2. Every split's (max, sum), 4 per unit, then the row's max `M` and denominator.
    let mut ms = Array::<f32>::new(4usize);
    let mut ls = Array::<f32>::new(4usize);
    let mut local = f32::new(NEG_BIG);
    #[unroll]
    for k in 0..4usize {
        let s = unit + k * units;
        ms[k] = f32::new(NEG_BIG);
        ls[k] = 0.0;
        if s < n {
            let at = (s * total + row) * 2;
            ms[k] = part_ml[at];
            ls[k] = part_ml[at + 1];
        }
        local = select(ls[k] > 0.0, max(local, ms[k]), local);
    }
    let warp_max = plane_max(local);
    if unit % 32 == 0 {
        warp_maxes[unit / 32] = warp_max;
    }
    sync_cube();
    let mut m = warp_maxes[0];
    #[unroll]
    for w in 1..8usize {
        m = max(m, warp_maxes[w]);
    }
    let mut den = 0.0f32;
    #[unroll]
    for k in 0..4usize {
        let s = unit + k * units;
        let w = select(ls[k] > 0.0, (ms[k] - m).exp(), 0.0);
        den += w * ls[k];
        if s < n {
            weights[s] = w;
        }
    }
    let warp_den = plane_sum(den);
    if unit % 32 == 0 {
        warp_dens[unit / 32] = warp_den;
    }
    sync_cube();

    // 3. Rounds of LOADS splits: the next round's loads go out before this one's adds.
    let mut num = Vector::<f32, Const<4>>::new(0.0);
    for s0 in range_stepped(lane, n, comptime!(lanes * LOADS)) {
        let mut next = Array::<Vector<f32, Const<4>>>::new(LOADS);
        #[unroll]
        for k in 0..LOADS {
            let s = s0 + (LOADS + k) * lanes;
            next[k] = Vector::new(0.0);
            if s < n {
                next[k] = part_out[(s * total + row) * 128 + vec];
            }
        }
        #[unroll]
        for k in 0..LOADS {
            let s = s0 + k * lanes;
            if s < n {
                num += Vector::new(weights[s]) * v[k];
            }
            v[k] = next[k];
        }
    }

    // 4. The lanes' sums (32 lanes: 4 at a time by 64 units first).
    sums[unit] = num;
    sync_cube();
    if comptime!(lanes > 8) {
        if unit < 64 {
            sums[unit] = sums[unit] + sums[unit + 64] + sums[unit + 128] + sums[unit + 192];
        }
        sync_cube();
    }
    if unit < vecs {
        let mut acc = sums[unit];
        #[unroll]
        for j in 1..comptime!(if lanes < 8 { lanes } else { 8 }) {
            acc += sums[unit + j * vecs];
        }
        let mut total_den = 0.0f32;
        #[unroll]
        for w in 0..8usize {
            total_den += warp_dens[w];
        }
        out[row * 128 + vec] = acc / Vector::new(total_den);
    }
}
