//! Runtime selection for kiln: which CubeCL runtime runs the kernels (wgpu or CUDA, chosen by
//! cargo features and `KILN_BACKEND`), what the device can do, and the macro that stamps out
//! one test per enabled backend.
//!
//! Code that runs kernels is generic over `cubecl::Runtime`; [`with_backend`] turns a
//! run-time [`BackendKind`] into a call of such code with the right runtime and client.
mod kind;
#[cfg(feature = "cuda")]
pub mod launcher;
mod memory;
mod report;
#[cfg(feature = "cuda")]
pub mod routed;
mod runtimes;
mod testgen;

pub use kind::{BackendError, BackendKind};
pub use memory::free_memory;
pub use report::DeviceReport;
#[cfg(feature = "wgpu")]
pub use runtimes::Wgpu;
pub use runtimes::{with_backend, Backend, BackendVisitor};
#[cfg(feature = "cuda")]
pub use runtimes::{Cuda, CudaRouted};
