//! The tensor-core decode GEMM (CUDA `mma.sync m16n8k16`, bf16 operands, f32 accumulators):
//! `C[M, N] = A[M, K] W[N, K]^T` for dense decode GEMMs (`M <= GEMV_MAX_M` for bf16,
//! `GEMV_MAX_M_NVFP4` for NVFP4; the kernel takes up to 8 groups of 8 tokens) and the grouped
//! MoE GEMM up to 32 rows per expert on average, where the time is the weight read.
//!
//! The weights are the MMA's A operand (16 rows), the tokens its B operand (8 per group), so
//! one decoded weight serves up to 8 tokens per instruction and nothing goes through shared
//! memory until the final reduction. A cube owns `tiles` tiles of 16 weight rows and its warps
//! split K in chunks of 64 columns; each warp loads `depth` chunks of raw weights (16 bytes
//! per lane per tile and chunk) before decoding any, then the warps' partial sums meet in
//! shared memory.
//!
//! NVFP4 weights come in the fragment layout (`fragments.rs`): a lane's word per 16-column
//! step is its 8 codes, placed so that `fragment_register` moves each register's two codes
//! onto bf16's sign, exponent and mantissa bits with at most two shifts and two masks
//! (`e2m1 * 2^-126`, exact; code 1, 0.5, lands on the bf16 subnormal `2^-127`). One bf16x2
//! multiply by the row's block scale as stored there (`scale * 2^112`) makes it
//! `e2m1 * scale * 2^-14`: normal and exact (at most 6 significant bits), so the MMAs
//! accumulate every step into one accumulator and `2^14 * global` is applied once at the
//! end (`fragments::decode_step`).
//!
//! bf16 weights stay row-major: a lane reads 16 contiguous bytes of rows `g` and `g + 8` per
//! 32 columns, and the activations are read in the same permuted column order (fragment
//! column `2c + b` is actual column `32 h + 8 c + 4 t + b`, `2c + 8 + b` is `... + 2 + b`,
//! for step `2h + t`), which leaves the dot product unchanged.
//!
//! Rounding: activations are rounded to bf16 (weights are exact), as in `mma.rs`.
use cubecl::prelude::*;
use half::bf16;

use super::fragments::{decode_step, TWO_POW_14};
use super::kernel::{find_expert_in_plane, find_tile};
use super::{Operand, OperandBuffers, WeightFormat};
use crate::warp_mma::{mma_step, Acc, Frag};
use crate::DeviceArray;

type Raw = Vector<u32, Const<4>>;

/// Compile-time shape of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemvConfig {
    /// NVFP4 in the fragment layout; otherwise bf16, row-major.
    pub nvfp4: bool,
    /// 16-row weight tiles per cube.
    pub tiles: u32,
    /// Groups of 8 tokens per cube (1..=8).
    pub groups: u32,
    /// Warps per cube, splitting K.
    pub warps: u32,
    /// 64-column chunks a warp loads before decoding the first.
    pub depth: u32,
    /// MoE: each cube row takes a run of up to `8 * groups` rows of one expert. With one
    /// group, one cube row per A row, working only where a run starts; with more, the grid's
    /// rows walk the runs (`find_tile`), at most `M / (8 * groups) + experts` of them.
    pub grouped: bool,
    /// SwiGLU (`tiles == 2`): a cube's tile 0 is 16 rows of the gate weights, tile 1 the same
    /// rows of the up weights, and it writes `silu(gate) * up` for those 16 rows.
    pub gated: bool,
}

/// The most token groups a grouped cube takes (runs of up to 32 rows of one expert).
pub const GROUPED_GROUPS: usize = 4;

/// Grid: (weight tiles / `tiles`, token groups or, grouped, A's rows); `32 * warps` units.
/// Trusts `k % 64 == 0`, NVFP4 `n % 16 == 0` in the fragment layout, validated buffers.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gemv_kernel<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Raw>,
    scales: &Array<Vector<u32, Const<2>>>,
    global_scales: &Array<u32>,
    up_weights: &Array<Raw>,
    up_scales: &Array<Vector<u32, Const<2>>>,
    up_global_scales: &Array<u32>,
    expert_offsets: &Array<u32>,
    out: &mut Array<f32>,
    m: u32,
    n: u32,
    k: u32,
    experts: u32,
    #[comptime] cfg: GemvConfig,
) {
    let per_cube = comptime!((cfg.groups * 8) as usize);
    let mut token0 = CUBE_POS_Y as usize * per_cube;
    let mut count = min(m as usize - token0, per_cube);
    let mut expert = 0usize;
    let mut active = true;
    if comptime!(cfg.grouped && cfg.groups > 1) {
        let mut slot = SharedMemory::<u32>::new(3usize);
        find_tile(
            expert_offsets,
            experts as usize,
            CUBE_POS_Y as usize,
            &mut slot,
            UNIT_POS_X as usize,
            comptime!(cfg.groups * 8),
            comptime!(cfg.warps * 32),
        );
        sync_cube();
        expert = slot[0] as usize;
        token0 = slot[1] as usize;
        count = slot[2] as usize - token0;
        active = count > 0;
    } else if comptime!(cfg.grouped) {
        token0 = CUBE_POS_Y as usize;
        expert = find_expert_in_plane(expert_offsets, token0 as u32, experts) as usize;
        let begin = expert_offsets[expert] as usize;
        let end = expert_offsets[expert + 1] as usize;
        active = (token0 - begin) % per_cube == 0;
        count = min(end - token0, per_cube);
    }
    // Uniform per cube: a cube that does not start a run leaves before the barrier.
    if active {
        let mut acc = Array::<Acc>::new(comptime!((cfg.tiles * cfg.groups * 2) as usize));
        #[unroll]
        for i in 0..comptime!((cfg.tiles * cfg.groups * 2) as usize) {
            acc[i] = Acc::new(0.0);
        }
        let warp = UNIT_POS_X as usize / 32;
        let chunks = k as usize / 64;
        let mut kc = warp;
        while kc < chunks {
            if comptime!(cfg.nvfp4) {
                nvfp4_chunks(
                    a, weights, scales, up_weights, up_scales, &mut acc, expert, token0, count, n,
                    k, kc, cfg,
                );
            } else {
                bf16_chunks(
                    a, weights, up_weights, &mut acc, expert, token0, count, n, k, kc, cfg,
                );
            }
            kc += comptime!((cfg.warps * cfg.depth) as usize);
        }
        let mut scale = 1.0f32;
        let mut up_scale = 1.0f32;
        if comptime!(cfg.nvfp4) {
            scale = f32::reinterpret(global_scales[expert]) * TWO_POW_14;
            if comptime!(cfg.gated) {
                up_scale = f32::reinterpret(up_global_scales[expert]) * TWO_POW_14;
            }
        }
        reduce_and_store(&acc, out, token0, count, n, scale, up_scale, cfg);
    }
}

/// Launches the tensor-core decode GEMM (grouped when `expert_offsets` is given); with `up`,
/// the SwiGLU pair: `out = silu(a w^T) * (a up^T)`, `w` the gate (same shape and format).
/// Trusts validated shapes, `k % 64 == 0` and NVFP4 weights in the fragment layout.
pub(super) fn launch<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: Operand<'_>,
    up: Option<Operand<'_>>,
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
    let up = up.map(|u| u.buffers::<R>());
    let gated = up.is_some();
    let nvfp4 = format == WeightFormat::Nvfp4;
    let grouped = expert_offsets.is_some();
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(1) as usize;
    let row_tiles = n.div_ceil(16);
    // Grouped: runs of 8 rows per expert where experts average up to 8 rows, more (up to
    // 32) where they average more.
    let groups = if grouped {
        m.div_ceil(experts.max(1) * 8).clamp(1, GROUPED_GROUPS)
    } else {
        m.div_ceil(8)
    };
    // Cube rows that work: 1 dense; grouped, one per run of rows of one expert (at most one
    // per row and per expert with one group; the grid's rows with more).
    let runs = match (grouped, groups) {
        (false, _) => 1,
        (true, 1) => m.min(experts.max(1)),
        (true, _) => m.min(m.div_ceil(8 * groups) + experts),
    };
    // Two tiles per cube halve the activation work where the tiles still give >= 4 cubes
    // per SM (and the accumulators of 2 tiles x groups fit the registers); a SwiGLU cube's
    // two tiles are the gate's and the up's rows.
    let tiles = if gated || (groups <= 2 && row_tiles * runs >= 8 * sms) {
        2
    } else {
        1
    };
    let cubes = if gated {
        row_tiles
    } else {
        row_tiles.div_ceil(tiles)
    };
    // The time is DRAM latency unless each SM has ~100 KB of loads in flight: ~32 warps per
    // SM (few working cubes split K over more warps per cube), each loading up to 4 KB of
    // weights (all of its chunks where they fit) before decoding any. The warps' partial
    // sums share 48 KB of shared memory (512 bytes per tile and group).
    let chunks = k / 64;
    let warps = (32 * sms)
        .div_ceil(cubes * runs)
        .next_power_of_two()
        .clamp(2, 16)
        .min(chunks.max(1))
        .min(96 / (tiles * groups));
    let max_depth = if nvfp4 { 8 / tiles } else { 4 / tiles };
    let depth = chunks.div_ceil(warps).clamp(1, max_depth);
    let cfg = GemvConfig {
        nvfp4,
        tiles: tiles as u32,
        groups: groups as u32,
        warps: warps as u32,
        depth: depth as u32,
        grouped,
        gated,
    };
    let y = match (grouped, groups) {
        (true, 1) => m,
        _ => runs,
    } as u32;
    let offsets = expert_offsets.unwrap_or(data);
    // Without `up`, the gate's buffers bind the up slots (never read).
    let (up_data, up_scales, up_globals) = match up {
        Some(u) => (u.data, u.scales, u.globals),
        None => (data, scales, data.arg()),
    };
    // SAFETY: validated shapes (the up weights match the gate's); the weight words bind
    // every slot the format does not read.
    unsafe {
        gemv_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(cubes as u32, y, 1),
            CubeDim::new_1d(32 * warps as u32),
            a.arg(),
            data.arg(),
            scales.arg(),
            globals,
            up_data.arg(),
            up_scales.arg(),
            up_globals,
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

/// The B fragments (2 per step, 4 steps) of token group `grp` for chunk `kc`, rounded to
/// bf16. Step `s` reads 4 consecutive activations at
/// `kc * 64 + offset(s)`: `16 s + 4 c` (NVFP4 fragments) or `32 (s / 2) + 8 c + 4 (s % 2)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn activations<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    token0: usize,
    count: usize,
    grp: usize,
    k: usize,
    kc: usize,
    #[comptime] nvfp4: bool,
) -> Array<Frag> {
    let lane = UNIT_POS_X as usize % 32;
    let (g, c) = (lane / 4, lane % 4);
    let row = token0 + min(grp * 8 + g, count - 1);
    let mut raw = Array::<Vector<F, Const<4>>>::new(4usize);
    #[unroll]
    for s in 0..4usize {
        let first = comptime!(if nvfp4 {
            16 * s
        } else {
            32 * (s / 2) + 4 * (s % 2)
        });
        let per_lane = comptime!(if nvfp4 { 4usize } else { 8usize });
        raw[s] = a[(row * k + kc * 64 + first + per_lane * c) / 4];
    }
    let mut frags = Array::<Frag>::new(8usize);
    #[unroll]
    for s in 0..4usize {
        #[unroll]
        for p in 0..2usize {
            let mut f = Frag::empty();
            f[0] = bf16::cast_from(raw[s][2 * p]);
            f[1] = bf16::cast_from(raw[s][2 * p + 1]);
            frags[s * 2 + p] = f;
        }
    }
    frags
}

/// Runs `cfg.depth` NVFP4 chunks (`kc`, `kc + warps`, ...), loading all their weights first.
#[cube]
#[allow(clippy::too_many_arguments)]
fn nvfp4_chunks<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Raw>,
    scales: &Array<Vector<u32, Const<2>>>,
    up_weights: &Array<Raw>,
    up_scales: &Array<Vector<u32, Const<2>>>,
    acc: &mut Array<Acc>,
    expert: usize,
    token0: usize,
    count: usize,
    n: u32,
    k: u32,
    kc0: usize,
    #[comptime] cfg: GemvConfig,
) {
    let depth = comptime!(cfg.depth as usize);
    let tiles = comptime!(cfg.tiles as usize);
    let lane = UNIT_POS_X as usize % 32;
    let (n, k) = (n as usize, k as usize);
    let chunks = k / 64;
    let row_tiles = n / 16;
    let mut raw = Array::<Raw>::new(comptime!((cfg.depth * cfg.tiles) as usize));
    let mut sraw = Array::<Vector<u32, Const<2>>>::new(comptime!((cfg.depth * cfg.tiles) as usize));
    #[unroll]
    for d in 0..depth {
        let kc = min(kc0 + d * comptime!(cfg.warps as usize), chunks - 1);
        #[unroll]
        for t in 0..tiles {
            let rt = min(row_tile(t, cfg), row_tiles - 1);
            let tile = (expert * row_tiles + rt) * chunks + kc;
            if comptime!(cfg.gated && t == 1) {
                raw[d * tiles + t] = up_weights[tile * 32 + lane];
                sraw[d * tiles + t] = up_scales[tile * 8 + lane / 4];
            } else {
                raw[d * tiles + t] = weights[tile * 32 + lane];
                sraw[d * tiles + t] = scales[tile * 8 + lane / 4];
            }
        }
    }
    #[unroll]
    for d in 0..depth {
        let kc = kc0 + d * comptime!(cfg.warps as usize);
        // Uniform per warp.
        if kc < chunks {
            let mut af = Array::<Frag>::new(comptime!((cfg.tiles * 16) as usize));
            #[unroll]
            for t in 0..tiles {
                #[unroll]
                for s in 0..4usize {
                    let sw = sraw[d * tiles + t];
                    let a_frag = decode_step(raw[d * tiles + t][s], sw[s / 2], s);
                    #[unroll]
                    for i in 0..4usize {
                        af[(t * 4 + s) * 4 + i] = a_frag[i];
                    }
                }
            }
            chunk_mmas(a, &af, acc, token0, count, k, kc, cfg);
        }
    }
}

/// Runs `cfg.depth` bf16 chunks, loading all their weights first (rows `g`, `g + 8` of each
/// tile, 2 x 16 bytes each).
#[cube]
#[allow(clippy::too_many_arguments)]
fn bf16_chunks<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    weights: &Array<Raw>,
    up_weights: &Array<Raw>,
    acc: &mut Array<Acc>,
    expert: usize,
    token0: usize,
    count: usize,
    n: u32,
    k: u32,
    kc0: usize,
    #[comptime] cfg: GemvConfig,
) {
    let depth = comptime!(cfg.depth as usize);
    let tiles = comptime!(cfg.tiles as usize);
    let lane = UNIT_POS_X as usize % 32;
    let (g, c) = (lane / 4, lane % 4);
    let (n, k) = (n as usize, k as usize);
    let chunks = k / 64;
    let mut raw = Array::<Raw>::new(comptime!((cfg.depth * cfg.tiles * 4) as usize));
    #[unroll]
    for d in 0..depth {
        let kc = min(kc0 + d * comptime!(cfg.warps as usize), chunks - 1);
        #[unroll]
        for t in 0..tiles {
            #[unroll]
            for half in 0..2usize {
                let row = min(row_tile(t, cfg) * 16 + g + half * 8, n - 1);
                let base = (expert * n + row) * k + kc * 64 + 8 * c;
                #[unroll]
                for h in 0..2usize {
                    let at = ((d * tiles + t) * 2 + half) * 2 + h;
                    if comptime!(cfg.gated && t == 1) {
                        raw[at] = up_weights[(base + 32 * h) / 8];
                    } else {
                        raw[at] = weights[(base + 32 * h) / 8];
                    }
                }
            }
        }
    }
    #[unroll]
    for d in 0..depth {
        let kc = kc0 + d * comptime!(cfg.warps as usize);
        // Uniform per warp.
        if kc < chunks {
            let mut af = Array::<Frag>::new(comptime!((cfg.tiles * 16) as usize));
            #[unroll]
            for t in 0..tiles {
                let at = (d * tiles + t) * 4;
                #[unroll]
                for s in 0..4usize {
                    let (h, w) = (s / 2, 2 * (s % 2));
                    let f = (t * 4 + s) * 4;
                    af[f] = Frag::reinterpret(raw[at + h][w]);
                    af[f + 1] = Frag::reinterpret(raw[at + 2 + h][w]);
                    af[f + 2] = Frag::reinterpret(raw[at + h][w + 1]);
                    af[f + 3] = Frag::reinterpret(raw[at + 2 + h][w + 1]);
                }
            }
            chunk_mmas(a, &af, acc, token0, count, k, kc, cfg);
        }
    }
}

/// The 16-row weight tile a cube's tile `t` reads: `tiles` consecutive ones, or for a SwiGLU
/// cube the same one from the gate (`t = 0`) and the up (`t = 1`) weights.
#[cube]
fn row_tile(#[comptime] t: usize, #[comptime] cfg: GemvConfig) -> usize {
    if comptime!(cfg.gated) {
        CUBE_POS_X as usize
    } else {
        CUBE_POS_X as usize * comptime!(cfg.tiles as usize) + t
    }
}

/// One chunk's MMAs: for each token group, its B fragments (read once) against every
/// tile's and step's A fragments (`af[(tile * 4 + step) * 4 + register]`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn chunk_mmas<F: Float>(
    a: &Array<Vector<F, Const<4>>>,
    af: &Array<Frag>,
    acc: &mut Array<Acc>,
    token0: usize,
    count: usize,
    k: usize,
    kc: usize,
    #[comptime] cfg: GemvConfig,
) {
    #[unroll]
    for grp in 0..comptime!(cfg.groups as usize) {
        let b = activations(a, token0, count, grp, k, kc, cfg.nvfp4);
        #[unroll]
        for t in 0..comptime!(cfg.tiles as usize) {
            #[unroll]
            for s in 0..4usize {
                mma_step(
                    af,
                    comptime!((t * 4 + s) * 4),
                    &b,
                    comptime!(s * 2),
                    acc,
                    comptime!((t * cfg.groups as usize + grp) * 2),
                );
            }
        }
    }
}

/// Sums the warps' accumulators in shared memory and writes `out[token0 + t, row] = sum *
/// scale` for the tokens and rows that exist; a SwiGLU cube writes `silu(gate * scale) *
/// (up * up_scale)` for its 16 rows. Accumulator `(tile, grp, half)` of lane `(g, c)` holds
/// rows `16 tile + g + 8 half` (of tile `row_tile(tile)`), tokens `8 grp + 2c` and `+ 1`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn reduce_and_store(
    acc: &Array<Acc>,
    out: &mut Array<f32>,
    token0: usize,
    count: usize,
    n: u32,
    scale: f32,
    up_scale: f32,
    #[comptime] cfg: GemvConfig,
) {
    let values = comptime!((cfg.tiles * cfg.groups * 4) as usize);
    let units = comptime!((cfg.warps * 32) as usize);
    let unit = UNIT_POS_X as usize;
    let (warp, lane) = (unit / 32, unit % 32);
    let mut partials = SharedMemory::<f32>::new(comptime!(
        (cfg.warps * cfg.tiles * cfg.groups * 128) as usize
    ));
    #[unroll]
    for i in 0..comptime!((cfg.tiles * cfg.groups * 2) as usize) {
        partials[((warp * values) + 2 * i) * 32 + lane] = acc[i][0];
        partials[((warp * values) + 2 * i + 1) * 32 + lane] = acc[i][1];
    }
    sync_cube();
    let n = n as usize;
    // A SwiGLU cube's outputs are its gate tile's; the up tile's follow them.
    let outputs = comptime!(if cfg.gated { values / 2 } else { values });
    for o in range_stepped(unit, outputs * 32, units) {
        let mut sum = 0.0f32;
        for w in 0..comptime!(cfg.warps as usize) {
            sum += partials[w * values * 32 + o];
        }
        let (v, l) = (o / 32, o % 32);
        let (i, col) = (v / 2, v % 2);
        let half = i % 2;
        let grp = (i / 2) % comptime!(cfg.groups as usize);
        let t = i / 2 / comptime!(cfg.groups as usize);
        let mut row = (CUBE_POS_X as usize * comptime!(cfg.tiles as usize) + t) * 16;
        let mut value = sum * scale;
        if comptime!(cfg.gated) {
            row = CUBE_POS_X as usize * 16;
            let mut up = 0.0f32;
            for w in 0..comptime!(cfg.warps as usize) {
                up += partials[w * values * 32 + outputs * 32 + o];
            }
            value = value / (1.0 + (-value).exp()) * (up * up_scale);
        }
        row += l / 4 + 8 * half;
        let token = grp * 8 + 2 * (l % 4) + col;
        if token < count && row < n {
            out[(token0 + token) * n + row] = value;
        }
    }
}
