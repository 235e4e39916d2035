//! The decode (skinny) GEMM: `C[M, N] = A[M, K] W[N, K]^T` for `M <= 16`, where the time is
//! the weight read. Design (GEMV in the style of TensorRT-LLM's and llama.cpp's decode
//! kernels):
//! - a cube owns `rows` consecutive output rows (N) and all `M` tokens; its units stride
//!   along K in chunks of one 16-byte vector of weight words (32 NVFP4 codes or 8 bf16), so
//!   a plane's loads of a row are contiguous and every weight byte is read exactly once;
//! - each unit loads its `rows` vectors (and, for NVFP4, the word holding their two E4M3
//!   block scales) before decoding any, so several independent loads are in flight;
//! - weights are decoded in registers once per row and reused by every token; the tokens'
//!   activations come through L1 (they are small and shared by all cubes);
//! - NVFP4 sums `a * e2m1` over each 16-value block and multiplies the block's sum by its
//!   scale (one multiply per block and token, not per value); the global scale is applied
//!   once per output;
//! - the cube reduces its units' partial sums with `plane_sum` and shared memory (CUDA), or
//!   through shared memory alone where there are no plane operations (wgpu on llvmpipe).
//!
//! E2M1 decode: with `subnormal_decode` (CUDA, whose NVRTC build keeps f32 subnormals) a
//! code becomes an f32 by bit placement alone, `((c & 7) << 22) | ((c & 8) << 28)`, which is
//! `e2m1(c) * 2^-126` exactly (code 1, 0.5, lands on the subnormal `2^-127`). Activations are
//! pre-multiplied by `2^64` and block scales by `2^62`, so the products are
//! `a * e2m1 * 2^-62`, normal and exact for bf16 activations, and the block multiply restores
//! the scale. This needs `|a| < 2^64`. Elsewhere (llvmpipe flushes subnormals) the portable
//! [`e2m1_to_f32`] is used. Both agree with the reference within its f32 accumulation bound.
use cubecl::prelude::*;

use super::kernel::find_expert;
use super::{Operand, OperandBuffers, WeightFormat};
use crate::formats::{e2m1_to_f32, e4m3_to_f32};
use crate::DeviceArray;

/// Compile-time shape of the skinny kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SkinnyConfig {
    /// Tokens held per unit: M rounded up to a power of two (at most 16); rows past M
    /// re-read row M - 1 and are not stored.
    pub tokens: u32,
    /// Output rows (N) per cube.
    pub rows: u32,
    /// Units per cube (a multiple of 32).
    pub units: u32,
    pub format: WeightFormat,
    /// Reduce with `plane_sum` (planes of 32) before shared memory.
    pub plane: bool,
    /// Decode E2M1 by bit placement into f32 subnormals (see the module docs).
    pub subnormal_decode: bool,
    /// MoE: rows of A sorted by expert, one cube row per A row (see [`skinny_kernel`]).
    pub grouped: bool,
}

/// `2^64`: the activations' pre-scale on the subnormal decode path.
const TWO_POW_64: f32 = 18446744073709551616.0;
/// `2^62`: the block scales' pre-scale on the subnormal decode path (`2^64 * 2^-126 * 2^62 = 1`).
const TWO_POW_62: f32 = 4611686018427387904.0;

/// One cube per `rows` output rows; `weights` as 16-byte vectors of u32 words, `scales` the
/// E4M3 bytes (NVFP4 only), `a` as vectors of 4 activations. Trusts `K % 32 == 0` (NVFP4)
/// or `K % 8 == 0` (bf16) and `1 <= m <= cfg.tokens` (dense).
///
/// Grouped (`cfg.grouped`, MoE decode): the grid's y axis is A's rows; the cube of row `y`
/// works only if `y` starts a run of `cfg.tokens` rows of its expert (found by binary search
/// over the device offsets), on up to `cfg.tokens` of them, with that expert's weights,
/// block scales and global scale. Other cubes leave at once, so only the touched experts'
/// weights are read.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn skinny_kernel<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Vector<u32, Const<4>>>,
    scales: &Array<u32>,
    global_scales: &Array<u32>,
    expert_offsets: &Array<u32>,
    out: &mut Array<f32>,
    m: u32,
    n: u32,
    k: u32,
    experts: u32,
    #[comptime] cfg: SkinnyConfig,
) {
    let rows = comptime!(cfg.rows as usize);
    let outputs = comptime!((cfg.tokens * cfg.rows) as usize);
    // Dense: (first token, token count, expert) = (0, m, 0).
    let mut first_row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * rows;
    let mut token0 = 0usize;
    let mut count = m;
    let mut expert = 0usize;
    let mut active = true;
    if comptime!(cfg.grouped) {
        first_row = CUBE_POS_X as usize * rows;
        token0 = CUBE_POS_Y as usize;
        expert = find_expert(expert_offsets, token0 as u32, experts) as usize;
        let begin = expert_offsets[expert] as usize;
        let end = expert_offsets[expert + 1] as usize;
        active = (token0 - begin) % comptime!(cfg.tokens as usize) == 0;
        count = min(end - token0, comptime!(cfg.tokens as usize)) as u32;
    }
    // Uniform per cube: whole cubes past N (or not starting a run) leave before any barrier.
    if first_row < n as usize && active {
        let mut total = Array::<f32>::new(outputs);
        #[unroll]
        for o in 0..outputs {
            total[o] = 0.0;
        }
        let w_row0 = expert * n as usize;
        if comptime!(cfg.format == WeightFormat::Nvfp4) {
            nvfp4_rows(
                a,
                weights,
                scales,
                &mut total,
                token0,
                count,
                n,
                k,
                w_row0 + first_row,
                cfg,
            );
        } else {
            bf16_rows(
                a,
                weights,
                &mut total,
                token0,
                count,
                n,
                k,
                w_row0 + first_row,
                cfg,
            );
        }
        let mut global = 1.0f32;
        if comptime!(cfg.format == WeightFormat::Nvfp4) {
            global = f32::reinterpret(global_scales[expert]);
        }
        reduce_and_store(&total, out, token0, count, n, first_row, global, cfg);
    }
}

/// The activation row token slot `t` reads: slots past the count re-read the last row.
#[cube]
fn token_row(token0: usize, t: usize, count: u32) -> usize {
    token0 + min(t, count as usize - 1)
}

/// Four activations as f32, times `prescale`.
#[cube]
fn load_a4<F: Float>(a: &Array<Vector<F, Const<4>>>, vec: usize, prescale: f32) -> Array<f32> {
    let v = a[vec];
    let mut x = Array::<f32>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        x[i] = f32::cast_from(v[i]) * prescale;
    }
    x
}

/// Code `j` (0..8) of `word` as f32: `e2m1 * 2^-126` by bit placement, or exactly.
#[cube]
fn decode_e2m1(word: u32, #[comptime] j: u32, #[comptime] subnormal: bool) -> f32 {
    let code = word >> comptime!(4 * j);
    if comptime!(subnormal) {
        f32::reinterpret(((code & 7) << 22) | ((code & 8) << 28))
    } else {
        e2m1_to_f32(code)
    }
}

/// NVFP4 main loop: accumulates `total[t * rows + r]` (before the global scale).
#[cube]
#[allow(clippy::too_many_arguments)]
fn nvfp4_rows<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Vector<u32, Const<4>>>,
    scales: &Array<u32>,
    total: &mut Array<f32>,
    token0: usize,
    count: u32,
    n: u32,
    k: u32,
    first_row: usize,
    #[comptime] cfg: SkinnyConfig,
) {
    let tokens = comptime!(cfg.tokens as usize);
    let rows = comptime!(cfg.rows as usize);
    let outputs = comptime!((cfg.tokens * cfg.rows) as usize);
    // `first_row` counts from the start of all experts' rows; clamp within this expert's.
    let last_row = first_row - first_row % n as usize + n as usize - 1;
    let k = k as usize;
    let chunks = k / 32;
    let blocks_per_row = k / 16;
    let mut a_prescale = 1.0f32;
    let mut s_prescale = 1.0f32;
    if comptime!(cfg.subnormal_decode) {
        a_prescale = TWO_POW_64;
        s_prescale = TWO_POW_62;
    }
    let mut partial = Array::<f32>::new(outputs);
    let mut codes = Array::<Vector<u32, Const<4>>>::new(rows);
    let mut scale_pairs = Array::<u32>::new(rows);
    let mut w = Array::<f32>::new(comptime!(cfg.rows as usize * 8));
    for c in range_stepped(UNIT_POS as usize, chunks, cfg.units as usize) {
        // Issue every row's loads before the first use.
        #[unroll]
        for r in 0..rows {
            let row = min(first_row + r, last_row);
            codes[r] = weights[row * chunks + c];
            // Blocks 2c and 2c + 1: two bytes of one word, since K / 16 is even.
            let byte = row * blocks_per_row + 2 * c;
            scale_pairs[r] = scales[byte / 4] >> (((byte % 4) * 8) as u32);
        }
        #[unroll]
        for blk in 0..2usize {
            #[unroll]
            for o in 0..outputs {
                partial[o] = 0.0;
            }
            #[unroll]
            for half in 0..2usize {
                let word_idx = blk * 2 + half;
                #[unroll]
                for r in 0..rows {
                    let word = codes[r][word_idx];
                    #[unroll]
                    for j in 0..8u32 {
                        w[r * 8 + j as usize] = decode_e2m1(word, j, cfg.subnormal_decode);
                    }
                }
                #[unroll]
                for t in 0..tokens {
                    let base = (token_row(token0, t, count) * k + c * 32 + word_idx * 8) / 4;
                    #[unroll]
                    for q in 0..2usize {
                        let x = load_a4(a, base + q, a_prescale);
                        #[unroll]
                        for r in 0..rows {
                            let mut acc = partial[t * rows + r];
                            #[unroll]
                            for i in 0..4usize {
                                acc += x[i] * w[r * 8 + q * 4 + i];
                            }
                            partial[t * rows + r] = acc;
                        }
                    }
                }
            }
            #[unroll]
            for r in 0..rows {
                let code = scale_pairs[r] >> comptime!(8 * blk as u32);
                let scale = e4m3_to_f32(code & 0xff) * s_prescale;
                #[unroll]
                for t in 0..tokens {
                    total[t * rows + r] += partial[t * rows + r] * scale;
                }
            }
        }
    }
}

/// bf16 main loop: accumulates `total[t * rows + r]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn bf16_rows<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Vector<u32, Const<4>>>,
    total: &mut Array<f32>,
    token0: usize,
    count: u32,
    n: u32,
    k: u32,
    first_row: usize,
    #[comptime] cfg: SkinnyConfig,
) {
    let tokens = comptime!(cfg.tokens as usize);
    let rows = comptime!(cfg.rows as usize);
    let k = k as usize;
    let chunks = k / 8;
    let last_row = first_row - first_row % n as usize + n as usize - 1;
    let mut words = Array::<Vector<u32, Const<4>>>::new(rows);
    let mut w = Array::<f32>::new(comptime!(cfg.rows as usize * 8));
    for c in range_stepped(UNIT_POS as usize, chunks, cfg.units as usize) {
        #[unroll]
        for r in 0..rows {
            let row = min(first_row + r, last_row);
            words[r] = weights[row * chunks + c];
        }
        #[unroll]
        for r in 0..rows {
            #[unroll]
            for i in 0..4usize {
                let word = words[r][i];
                // Element 2i in the low half, 2i + 1 in the high half.
                w[r * 8 + 2 * i] = f32::reinterpret(word << 16);
                w[r * 8 + 2 * i + 1] = f32::reinterpret(word & 0xffff0000u32);
            }
        }
        #[unroll]
        for t in 0..tokens {
            let base = (token_row(token0, t, count) * k + c * 8) / 4;
            #[unroll]
            for q in 0..2usize {
                let x = load_a4(a, base + q, 1.0f32);
                #[unroll]
                for r in 0..rows {
                    let mut acc = total[t * rows + r];
                    #[unroll]
                    for i in 0..4usize {
                        acc += x[i] * w[r * 8 + q * 4 + i];
                    }
                    total[t * rows + r] = acc;
                }
            }
        }
    }
}

/// Sums `total` over the cube's units and writes `out[t, first_row + r] = sum * global` for
/// the tokens and rows that exist.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_and_store(
    total: &Array<f32>,
    out: &mut Array<f32>,
    token0: usize,
    count: u32,
    n: u32,
    first_row: usize,
    global: f32,
    #[comptime] cfg: SkinnyConfig,
) {
    let rows = comptime!(cfg.rows as usize);
    let outputs = comptime!((cfg.tokens * cfg.rows) as usize);
    let unit = UNIT_POS as usize;
    let mut sum = 0.0f32;
    if comptime!(cfg.plane) {
        let planes = comptime!(cfg.units as usize / 32);
        let mut partials =
            SharedMemory::<f32>::new(comptime!((cfg.tokens * cfg.rows * cfg.units / 32) as usize));
        #[unroll]
        for o in 0..outputs {
            let v = plane_sum(total[o]);
            if unit % 32 == 0 {
                partials[(unit / 32) * outputs + o] = v;
            }
        }
        sync_cube();
        if unit < outputs {
            for p in 0..planes {
                sum += partials[p * outputs + unit];
            }
        }
    } else {
        let units = comptime!(cfg.units as usize);
        let mut partials =
            SharedMemory::<f32>::new(comptime!((cfg.tokens * cfg.rows * cfg.units) as usize));
        #[unroll]
        for o in 0..outputs {
            partials[o * units + unit] = total[o];
        }
        sync_cube();
        if unit < outputs {
            for u in 0..units {
                sum += partials[unit * units + u];
            }
        }
    }
    if unit < outputs {
        let t = unit / rows;
        let row = first_row + unit % rows;
        if t < count as usize && row < n as usize {
            out[(token0 + t) * n as usize + row] = sum * global;
        }
    }
}

/// The skinny kernel's compile-time shape for `m` tokens and rows of `k` elements.
fn skinny_config<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    k: usize,
    format: WeightFormat,
    grouped: bool,
) -> SkinnyConfig {
    let props = client.properties();
    let hw = &props.hardware;
    let plane = props
        .features
        .plane
        .contains(cubecl::ir::features::Plane::Ops)
        && hw.plane_size_min == 32
        && hw.plane_size_max == 32;
    // Grouped: a cube per run of `tokens` rows of one expert; decode routes most experts
    // one row, so runs of 1 until the batch makes repeats common.
    let tokens = match (grouped, m) {
        (false, _) => m.next_power_of_two() as u32,
        (true, ..=64) => 1,
        (true, _) => 4,
    };
    let vectors_per_row = match format {
        WeightFormat::Nvfp4 => k / 32,
        WeightFormat::Bf16 => k / 8,
    };
    SkinnyConfig {
        tokens,
        // Registers: tokens * rows partial and running sums per unit.
        rows: if tokens <= 4 { 4 } else { 2 },
        units: 32 * vectors_per_row.div_ceil(32).clamp(1, 4) as u32,
        format,
        plane,
        // NVRTC (no -ftz) keeps f32 subnormals; llvmpipe flushes them.
        subnormal_decode: R::name(client) == "cuda",
        grouped,
    }
}

/// The grid of the skinny kernel: one cube per `rows` output rows, folded into two
/// dimensions past 65,535 cubes.
fn skinny_cubes(n: usize, rows: u32) -> CubeCount {
    let cubes = (n as u32).div_ceil(rows);
    let x = cubes.min(65_535);
    CubeCount::Static(x, cubes.div_ceil(x), 1)
}

/// Launches the decode (skinny) GEMM without validation (grouped when `expert_offsets` is
/// given): trusts `1 <= m <= 16` (dense), rows of whole 16-byte vectors (`k % 32 == 0` for
/// NVFP4, `k % 8 == 0` for bf16), row-major weights and buffers matching the shapes.
pub(super) fn launch<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: Operand<'_>,
    expert_offsets: Option<&DeviceArray<u32>>,
    out: &DeviceArray<f32>,
) {
    let OperandBuffers {
        data,
        scales,
        globals,
        format,
        experts,
        n,
        k,
    } = w.buffers();
    let cfg = skinny_config(client, m, k, format, expert_offsets.is_some());
    let cubes = match expert_offsets {
        Some(_) => CubeCount::Static((n as u32).div_ceil(cfg.rows), m as u32, 1),
        None => skinny_cubes(n, cfg.rows),
    };
    // A dense launch never reads the offsets slot; the weight words bind it.
    let offsets = expert_offsets.unwrap_or(data);
    // SAFETY: the caller guarantees the shapes; rows hold whole vectors of 4 words.
    unsafe {
        skinny_kernel::launch_unchecked::<F, R>(
            client,
            cubes,
            CubeDim::new_1d(cfg.units),
            a.arg(),
            data.arg(),
            scales.arg(),
            globals,
            offsets.arg(),
            out.arg(),
            m as u32,
            n as u32,
            k as u32,
            experts as u32,
            cfg,
        )
    }
}
