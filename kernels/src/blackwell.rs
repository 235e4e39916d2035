//! Blackwell's native FP4 tensor-core path: block-scaled MMA over NVFP4 operands.
//!
//! NVFP4 is E2M1 values with one E4M3 scale per 16 values along K (and an f32 tensor scale
//! the caller applies). Blackwell multiplies it in hardware; what CubeCL 0.10 can emit is
//! the warp-level `mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64`
//! (E2M1 x E2M1 -> f32, UE4M3 scales), offered for arch 12.x only. This module holds:
//! - [`nvfp4_mma_tile_kernel`]: one warp, one 16 x 8 x 64 tile of `A x W^T` through
//!   CubeCL's manual block-scaled MMA (`MmaDefinition::new_scaled` + `execute_scaled`);
//! - [`nvfp4_mma_tile_source`]: that kernel's CUDA C++ as CubeCL's CUDA compiler writes it,
//!   generated on the host for a given arch (no device, no driver), so the conformance
//!   suite can check it and compile it with NVRTC;
//! - [`supports_native_fp4`]: whether a device advertises that MMA, for the dispatch.
//!
//! Where it compiles (ptxas of CUDA 13.0, and NVRTC 13.5 in the conformance suite): `sm_120a`, `sm_120f` and `sm_121a` (consumer and
//! workstation Blackwell, GB10) accept the instruction; `sm_100a`, `sm_103a` and `sm_110a`
//! reject it ("Instruction 'mma with block scale' not supported"): datacenter Blackwell
//! (B200/GB200/B300) has block-scaled MMA only as `tcgen05.mma ... .block_scale`, issued by
//! one thread with operands in shared and tensor memory, and CubeCL 0.10 has no tcgen05
//! nor tensor memory. Nothing here runs on the H200 (sm_90): the NVFP4 GEMM always takes
//! the decode-to-bf16 path, and this kernel is compiled, not launched, by the tests.
use cubecl::ir::features::ScaledMmaConfig;
use cubecl::prelude::*;
use cubecl::{e2m1x2, e4m3};
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaWmmaCompiler;
use cubecl_cpp::DialectWmmaCompiler;

use crate::cuda_source::{cuda_source, input, output};
use crate::KernelError;

/// One 32-bit MMA register of FP4 operands: 8 E2M1 codes along K, the lowest K in the
/// lowest nibble.
type Fp4x8 = Vector<e2m1x2, Const<4>>;
/// The 4 E4M3 block scales of one row of `A` (or of `W`) over the tile's 64 K, one per 16.
type Scales4 = Vector<e4m3, Const<4>>;
/// Two f32 accumulators of adjacent columns.
type Acc = Vector<f32, Const<2>>;

/// `out = A x W^T` for one 16 x 8 tile over K = 64, both operands NVFP4, on one warp (32
/// units, one cube): a 16-row slice of activations quantised to NVFP4 times 8 NVFP4 weight
/// rows, the layout of kiln's NVFP4 GEMM (the f32 tensor scales are left to the caller).
///
/// - `a`: 16 rows x 64 E2M1 codes, row-major, 8 registers per row;
/// - `w`: 8 weight rows x 64 codes, the same layout (`B` of the MMA, column-major);
/// - `a_scales`: 16 rows x 4 E4M3 scales, `w_scales`: 8 rows x 4 (scale `j` covers K
///   `16j..16j+16`);
/// - `out`: 16 x 8 f32, row-major, as 64 pairs.
///
/// Fragments (PTX ISA, `mma.m16n8k64` with `.e2m1`; lane = 4 g + t): `A` register `i` holds
/// row `g + 8 (i % 2)`, K `8 t + 32 (i / 2) ..+8`; `B` register `i` holds column `g`, K
/// `8 t + 32 i ..+8`; accumulator `i` holds row `g + 8 i`, columns `2 t, 2 t + 1`. With
/// `scale_vec::4X` and thread/byte selectors 0 (what CubeCL emits), lanes `t = 0, 1` of each
/// quad give the scales of rows `g`, `g + 8` of `A` and lane `t = 0` those of column `g` of
/// `B` (CubeCL's `MmaDefinition::scales_index`).
#[cube(launch_unchecked)]
pub fn nvfp4_mma_tile_kernel(
    a: &Array<Fp4x8>,
    w: &Array<Fp4x8>,
    a_scales: &Array<Scales4>,
    w_scales: &Array<Scales4>,
    out: &mut Array<Acc>,
) {
    let mma = cmma::MmaDefinition::<e2m1x2, e2m1x2, f32>::new_scaled::<e4m3>(
        16usize, 8usize, 64usize, 4usize,
    );
    let lane = UNIT_POS_PLANE;
    let g = (lane / 4) as usize;
    let t = (lane % 4) as usize;
    let mut a_frag = Array::<Fp4x8>::new(4usize);
    #[unroll]
    for i in 0..4usize {
        a_frag[i] = a[(g + 8 * (i % 2)) * 8 + 4 * (i / 2) + t];
    }
    let mut w_frag = Array::<Fp4x8>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        w_frag[i] = w[g * 8 + 4 * i + t];
    }
    let mut c = Array::<Acc>::new(2usize);
    c[0] = Acc::new(0.0);
    c[1] = Acc::new(0.0);
    // Mutable so that CubeCL declares them non-const: its CUDA hands the scales to the MMA as
    // `reinterpret_cast<uint32&>`, which C++ refuses on a const (nvcc: "cannot cast away const").
    #[allow(unused_mut)]
    let mut a_scale = a_scales[mma.scales_index(lane, cmma::MatrixIdent::A) as usize];
    #[allow(unused_mut)]
    let mut w_scale = w_scales[mma.scales_index(lane, cmma::MatrixIdent::B) as usize];
    let d = mma.execute_scaled(&a_frag, &w_frag, &c, a_scale, w_scale);
    #[unroll]
    for i in 0..2usize {
        out[(g + 8 * i) * 4 + t] = d[i];
    }
}

/// The block-scaled MMA [`nvfp4_mma_tile_kernel`] needs: E2M1 (packed by 2) operands, f32
/// accumulators, E4M3 scales per 16 values (4 per K = 64), m16n8k64.
pub fn nvfp4_mma_config() -> ScaledMmaConfig {
    ScaledMmaConfig {
        a_type: e2m1x2::cube_type(),
        b_type: e2m1x2::cube_type(),
        cd_type: f32::cube_type(),
        scales_type: e4m3::cube_type(),
        m: 16,
        n: 8,
        k: 64,
        scales_factor: 4,
    }
}

/// True when the device advertises the NVFP4 block-scaled MMA ([`nvfp4_mma_config`]).
pub fn supports_native_fp4<R: Runtime>(client: &ComputeClient<R>) -> bool {
    client
        .properties()
        .features
        .matmul
        .scaled_mma
        .contains(&nvfp4_mma_config())
}

/// The CUDA C++ of [`nvfp4_mma_tile_kernel`] that CubeCL 0.10's CUDA runtime would hand to
/// NVRTC on a device of compute capability `arch` (`120` for sm_120), generated on the host.
///
/// One warp ([`cuda_source`]). The text itself does not depend on `arch`; the arch decides
/// whether CubeCL offers the block-scaled MMA at all, and which target NVRTC compiles for
/// (the runtime passes `sm_{arch}a`). Refuses an arch without the MMA in CubeCL's list
/// (12.x only).
pub fn nvfp4_mma_tile_source(arch: u32) -> Result<String, KernelError> {
    let offered =
        CudaWmmaCompiler::supported_scaled_mma_combinations(&CudaArchitecture { version: arch });
    if !offered.contains(&nvfp4_mma_config()) {
        return Err(KernelError::Unsupported {
            feature: "block-scaled NVFP4 mma.sync m16n8k64 in CubeCL 0.10".into(),
            device: format!("sm_{arch}"),
        });
    }
    cuda_source("nvfp4_mma_tile_kernel", CubeDim::new_1d(32), |builder| {
        let (a, w) = (input::<Fp4x8>(builder), input::<Fp4x8>(builder));
        let (a_scales, w_scales) = (input::<Scales4>(builder), input::<Scales4>(builder));
        let out = output::<Acc>(builder);
        nvfp4_mma_tile_kernel::expand(&mut builder.scope, a, w, a_scales, w_scales, out);
    })
    .map(|kernel| kernel.text)
}
