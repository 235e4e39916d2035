//! Whether a device can run kiln's tensor-core kernels (the tiled GEMM and the split-KV MLA
//! attention): bf16 `mma.sync m16n8k16` with f32 accumulators, `ldmatrix` on bf16 and plane
//! (warp) operations. CUDA on sm_80+ has them; llvmpipe and most wgpu adapters do not, and
//! take the portable kernels.
use cubecl::ir::features::Plane;
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;

/// True when the device has what the tensor-core kernels use.
pub fn has_bf16_mma<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let features = &client.properties().features;
    let bf16 = StorageType::Scalar(ElemType::Float(FloatKind::BF16));
    let f32 = StorageType::Scalar(ElemType::Float(FloatKind::F32));
    features.plane.contains(Plane::Ops)
        && features.matmul.ldmatrix.contains(&bf16)
        && features.matmul.mma.iter().any(|c| {
            (c.m, c.n, c.k) == (16, 8, 16)
                && c.a_type == bf16
                && c.b_type == bf16
                && c.cd_type == f32
        })
}
