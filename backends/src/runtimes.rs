//! The compiled-in runtimes, each behind the [`Backend`] trait, and dispatch by kind.
use cubecl::prelude::*;

use crate::{BackendError, BackendKind, DeviceReport};

/// A runtime kiln can run kernels on, with one shared device per process.
pub trait Backend {
    type Runtime: Runtime;
    const KIND: BackendKind;
    /// A client of the process's device (created on first use).
    fn client() -> ComputeClient<Self::Runtime>;
    /// What the device is and can do.
    fn report() -> DeviceReport;
}

/// Code generic over the runtime, called by [`with_backend`] once the kind is known.
pub trait BackendVisitor {
    type Output;
    fn visit<R: Runtime>(self, client: ComputeClient<R>, report: DeviceReport) -> Self::Output;
}

/// Runs `visitor` on the backend `kind` (which must be compiled in).
pub fn with_backend<V: BackendVisitor>(
    kind: BackendKind,
    visitor: V,
) -> Result<V::Output, BackendError> {
    match kind {
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => Ok(visitor.visit(Wgpu::client(), Wgpu::report())),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => Ok(visitor.visit(Cuda::client(), Cuda::report())),
        #[cfg(feature = "cuda")]
        BackendKind::CudaRouted => Ok(visitor.visit(CudaRouted::client(), CudaRouted::report())),
        #[allow(unreachable_patterns)]
        other => Err(BackendError::NotCompiled(other)),
    }
}

/// The portable backend: wgpu on the first adapter it finds (llvmpipe on a CPU-only machine).
#[cfg(feature = "wgpu")]
pub struct Wgpu;

#[cfg(feature = "wgpu")]
mod wgpu_backend {
    use std::sync::OnceLock;

    use cubecl::wgpu::{init_device, init_setup, AutoGraphicsApi, WgpuDevice, WgpuRuntime};

    use super::*;

    /// The device with its adapter's name and kind, set up once per process.
    fn device() -> &'static (WgpuDevice, String, String) {
        static DEVICE: OnceLock<(WgpuDevice, String, String)> = OnceLock::new();
        DEVICE.get_or_init(|| {
            let setup =
                init_setup::<AutoGraphicsApi>(&WgpuDevice::DefaultDevice, Default::default());
            let info = setup.adapter.get_info();
            let arch = format!(
                "{:?} {:?} ({})",
                info.backend, info.device_type, info.driver
            );
            let name = info.name.clone();
            (init_device(setup, Default::default()), name, arch)
        })
    }

    impl Backend for Wgpu {
        type Runtime = WgpuRuntime;
        const KIND: BackendKind = BackendKind::Wgpu;

        fn client() -> ComputeClient<WgpuRuntime> {
            WgpuRuntime::client(&device().0)
        }

        fn report() -> DeviceReport {
            let (_, name, arch) = device();
            DeviceReport::from_client(Self::KIND, name.clone(), arch.clone(), &Self::client())
        }
    }
}

/// NVIDIA GPUs through CUDA (device 0).
#[cfg(feature = "cuda")]
pub struct Cuda;

/// CUDA (device 0) with kernels and copies on kiln's stream: [`crate::routed::KilnCuda`].
#[cfg(feature = "cuda")]
pub struct CudaRouted;

#[cfg(feature = "cuda")]
mod cuda_backend {
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    use super::*;
    use crate::routed::KilnCuda;

    /// Device 0's name and compute capability, which CubeCL does not report.
    fn device_name() -> (String, String) {
        match cudarc::driver::CudaContext::new(0) {
            Ok(ctx) => {
                let name = ctx.name().unwrap_or_else(|e| format!("unknown ({e})"));
                let arch = match ctx.compute_capability() {
                    Ok((major, minor)) => format!("sm_{major}{minor}"),
                    Err(e) => format!("unknown ({e})"),
                };
                (name, arch)
            }
            Err(e) => (format!("unavailable ({e})"), "unknown".to_string()),
        }
    }

    impl Backend for Cuda {
        type Runtime = CudaRuntime;
        const KIND: BackendKind = BackendKind::Cuda;

        fn client() -> ComputeClient<CudaRuntime> {
            CudaRuntime::client(&CudaDevice::default())
        }

        fn report() -> DeviceReport {
            let (name, arch) = device_name();
            DeviceReport::from_client(Self::KIND, name, arch, &Self::client())
        }
    }

    impl Backend for CudaRouted {
        type Runtime = KilnCuda;
        const KIND: BackendKind = BackendKind::CudaRouted;

        fn client() -> ComputeClient<KilnCuda> {
            KilnCuda::client(&CudaDevice::default())
        }

        fn report() -> DeviceReport {
            let (name, arch) = device_name();
            DeviceReport::from_client(Self::KIND, name, arch, &Self::client())
        }
    }
}
