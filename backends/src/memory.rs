//! How much device memory is free now, where the backend can tell: what the engine sizes
//! its KV pool from after the weights are loaded.
use crate::BackendKind;

/// Free device memory in bytes (CUDA: the driver's figure for device 0); `None` where the
/// backend cannot say (wgpu).
pub fn free_memory(kind: BackendKind) -> Option<u64> {
    match kind {
        #[cfg(feature = "cuda")]
        BackendKind::Cuda | BackendKind::CudaRouted => cudarc::driver::CudaContext::new(0)
            .and_then(|ctx| ctx.mem_get_info())
            .map(|(free, _total)| free as u64)
            .ok(),
        _ => None,
    }
}
