//! Merges the partial results of a split-KV attention launch (`mma.rs`, `wide.rs`): each
//! split wrote its rows' unnormalised sums and (max, sum); the output is their
//! softmax-weighted combination.
use cubecl::prelude::*;

use super::mma::NEG_BIG;

/// Units of the combine: 32 split lanes x 8 vectors of 4 dimensions.
pub const COMBINE_UNITS: u32 = 256;
/// Output dimensions per combine cube.
pub const COMBINE_DIMS: u32 = 32;

/// Merges the splits of one query row: `out = sum_s e^{m_s - M} O_s / sum_s e^{m_s - M} l_s`
/// over the splits that saw any position (`l_s > 0`). A cube per (row, 32 dimensions):
/// unit `u` takes the splits `s = u / 8 (mod 32)` and the 4 dimensions `u % 8`, so each
/// unit walks at most `splits / 32` splits; the 32 split lanes meet in shared memory.
#[cube(launch_unchecked)]
pub fn combine_kernel(
    part_out: &Array<Vector<f32, Const<4>>>,
    part_ml: &Array<f32>,
    out: &mut Array<Vector<f32, Const<4>>>,
    total_rows: u32,
    splits: u32,
) {
    let row = CUBE_POS_X as usize;
    let block = CUBE_POS_Y as usize;
    let unit = UNIT_POS_X as usize;
    let lane = unit / 8;
    let vec = block * 8 + unit % 8;
    let total = total_rows as usize;
    let mut maxes = SharedMemory::<f32>::new(32usize);
    let mut sums = SharedMemory::<Vector<f32, Const<4>>>::new(256usize);
    let mut dens = SharedMemory::<f32>::new(32usize);
    let mut m = f32::new(NEG_BIG);
    for s in range_stepped(lane, splits as usize, 32usize) {
        let at = (s * total + row) * 2;
        m = select(part_ml[at + 1] > 0.0, max(m, part_ml[at]), m);
    }
    if unit % 8 == 0 {
        maxes[lane] = m;
    }
    sync_cube();
    #[unroll]
    for l in 0..32usize {
        m = max(m, maxes[l]);
    }
    let mut num = Vector::<f32, Const<4>>::new(0.0);
    let mut den = 0.0f32;
    for s in range_stepped(lane, splits as usize, 32usize) {
        let at = (s * total + row) * 2;
        let l = part_ml[at + 1];
        let w = select(l > 0.0, (part_ml[at] - m).exp(), 0.0);
        den += w * l;
        num += Vector::new(w) * part_out[(s * total + row) * 128 + vec];
    }
    sums[unit] = num;
    if unit % 8 == 0 {
        dens[lane] = den;
    }
    sync_cube();
    if unit < 8 {
        let mut acc = Vector::<f32, Const<4>>::new(0.0);
        let mut total_den = 0.0f32;
        #[unroll]
        for l in 0..32usize {
            acc += sums[l * 8 + unit];
            total_den += dens[l];
        }
        out[row * 128 + vec] = acc / Vector::new(total_den);
    }
}
