//! The named place for Blackwell's native FP4 tensor-core path.
//!
//! sm_100+ multiplies E2M1 with E4M3 block scales in hardware (block-scaled MMA). CubeCL 0.10
//! exposes block-scaled `mma.sync` only for arch 12.x and offers no tcgen05, so nothing runs
//! here yet: the NVFP4 GEMM always takes the decode-in-registers path. This module answers
//! whether a device could take the native path, so the dispatch is already in place.
use cubecl::prelude::*;

/// True when the device advertises a block-scaled MMA over E2M1 operands.
pub fn supports_native_fp4<R: Runtime>(client: &ComputeClient<R>) -> bool {
    client
        .properties()
        .features
        .matmul
        .scaled_mma
        .iter()
        .any(|cfg| format!("{:?}", cfg.a_type).to_lowercase().contains("e2m1"))
}
