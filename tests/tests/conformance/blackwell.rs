//! Blackwell's native FP4 path compiles: [`nvfp4_mma_tile_kernel`]'s CUDA C++ is generated on
//! the host (any machine) and compiled by NVRTC ([`Nvrtc`]) to cubins for the Blackwell
//! targets. It cannot run on the H200 (sm_90) nor here: compiling is all this proves.
//!
//! [`nvfp4_mma_tile_kernel`]: kiln_kernels::blackwell::nvfp4_mma_tile_kernel
use kiln_kernels::blackwell::nvfp4_mma_tile_source;
use kiln_kernels::KernelError;

use crate::nvrtc::Nvrtc;

/// The block-scaled NVFP4 MMA as CubeCL writes it (E2M1 operands, f32, UE4M3 scales per 16).
const NVFP4_MMA: &str = "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64\
                         .row.col.f32.e2m1.e2m1.f32.ue4m3";

#[test]
fn native_fp4_mma_compiles_for_blackwell() {
    let source = nvfp4_mma_tile_source(120).expect("CubeCL offers the NVFP4 MMA on sm_120");
    assert!(
        source.contains(NVFP4_MMA),
        "no block-scaled NVFP4 mma in:\n{source}"
    );
    assert!(
        source.contains("nvfp4_mma_tile_kernel ("),
        "no kernel entry point in:\n{source}"
    );
    // CubeCL 0.10 offers block-scaled mma.sync only for arch 12.x, not for sm_100 (nor sm_90).
    for arch in [90, 100] {
        assert!(matches!(
            nvfp4_mma_tile_source(arch),
            Err(KernelError::Unsupported { .. })
        ));
    }

    let nvrtc = Nvrtc::get().unwrap_or_else(|why| panic!("{why}"));
    // Consumer/workstation Blackwell and GB10 have the warp-level block-scaled MMA.
    for arch in ["sm_120a", "sm_121a"] {
        match nvrtc.cubin(&source, arch) {
            Ok(bytes) => println!("{arch}: compiled, {bytes} bytes of cubin"),
            Err(log) => panic!("{arch}: NVRTC rejected it:\n{log}\n{source}"),
        }
    }
    // Datacenter Blackwell has block-scaled MMA only as tcgen05.mma (tensor memory), which
    // CubeCL 0.10 cannot emit: ptxas refuses the warp-level form there.
    let log = nvrtc
        .cubin(&source, "sm_100a")
        .expect_err("sm_100a took mma.sync block_scale");
    assert!(
        log.contains("'mma with block scale' not supported on .target 'sm_100a'"),
        "sm_100a: unexpected NVRTC log:\n{log}"
    );
    let why = log
        .lines()
        .find(|l| l.contains("not supported"))
        .unwrap_or_default();
    println!("sm_100a: rejected as expected: {why}");
}
