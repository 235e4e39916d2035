//! A CubeCL runtime whose kernels run on kiln's own CUDA stream (issue 29): [`KilnCuda`].
//!
//! CubeCL 0.10 launches on streams of its own that nothing outside it reaches, so its
//! launches can neither be captured into a CUDA graph nor ordered against kiln's work. Its
//! server trait is public, though, and so is the CUDA server behind it
//! (`<CudaRuntime as Runtime>::Server`, built by `DeviceService::init`). [`KilnCuda`] is
//! CubeCL's CUDA runtime with that server wrapped ([`Routed`]): every kernel any of kiln's
//! code launches through a `ComputeClient<KilnCuda>` is compiled as CubeCL's runtime compiles
//! it (CubeCL's CUDA compiler and options, NVRTC with its flags: [`Launcher::load`]) and
//! launched on the [`Launcher`]'s stream with the addresses and info CubeCL would pass. No
//! kernel needs a launcher-specific twin.
//!
//! Copies go the same way, so CubeCL's own stream carries nothing kiln's must wait for:
//! writes are `cuMemcpyHtoDAsync` on kiln's stream to the buffer's address, reads copy into
//! pinned staging on kiln's stream and complete when its event does. CubeCL still manages
//! memory: its pools grow (and shrink) in its stream's order, so a change is waited for
//! (its stream synchronised) before kiln's stream may touch the new memory. What the wrapper
//! does not route (a dynamic cube count, tensor maps, info too long to pass by value: kiln
//! uses none of them) runs on CubeCL's stream between synchronisations of both.
//!
//! A sync waits for both streams. Errors of routed work are reported by the next sync or
//! read, as CubeCL reports its own.
//!
//! Since every launch lands on kiln's stream, [`capture`] records what any code issues
//! through a client into a CUDA graph: kiln's kernel functions, unchanged. The recorded
//! work may launch kernels only (no copies, reads or syncs: those are not capturable). The
//! buffers it uses must outlive the graph and stay where they are: those made before the
//! capture are the caller's to keep; every allocation made while it records (the kernel
//! functions' scratch, freed when they return) is held by the [`Captured`] graph, so no
//! later allocation lands in memory a replay writes.
//!
//! Checked on an H100 (2026-12-07, session 27): the `cuda_routed::` conformance tests (62/62),
//! `hf_conformance::the_routed_runtime_computes_cubecls_bits` and the capture test in
//! `tests/tests/conformance/launcher.rs`.
use std::sync::{Arc, OnceLock};

use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::DeviceId;
use cubecl::ir::TargetProperties;
use cubecl::prelude::*;
use cubecl::server::ComputeServer;
use cubecl::zspace::{Shape, Strides};
use cubecl_runtime::memory_management::ManagedMemoryHandle;
use cubecl_runtime::storage::ComputeStorage;
use cudarc::driver::{CudaGraph, CudaStream};

use kiln_kernels::DeviceArray;

use crate::launcher::{capture_on, LaunchError};

mod copies;
mod server;

pub use server::Routed;

type Inner = <CudaRuntime as Runtime>::Server;
type Compiler = <CudaRuntime as Runtime>::Compiler;
type Resource = <<Inner as ComputeServer>::Storage as ComputeStorage>::Resource;

/// CubeCL's CUDA runtime, its launches and copies on kiln's stream ([`Routed`]).
#[derive(Clone, Debug)]
pub struct KilnCuda;

impl Runtime for KilnCuda {
    type Compiler = Compiler;
    type Server = Routed;
    type Device = CudaDevice;

    fn client(device: &CudaDevice) -> ComputeClient<Self> {
        ComputeClient::load(device)
    }

    /// "cuda", as CubeCL's: the same compiler and device (kernels choose paths by it).
    fn name(_: &ComputeClient<Self>) -> &'static str {
        "cuda"
    }

    fn require_array_lengths() -> bool {
        CudaRuntime::require_array_lengths()
    }

    fn max_cube_count() -> (u32, u32, u32) {
        CudaRuntime::max_cube_count()
    }

    fn can_read_tensor(shape: &Shape, strides: &Strides) -> bool {
        CudaRuntime::can_read_tensor(shape, strides)
    }

    fn target_properties() -> TargetProperties {
        CudaRuntime::target_properties()
    }

    fn enumerate_devices(type_id: u16, info: &()) -> Vec<DeviceId> {
        CudaRuntime::enumerate_devices(type_id, info)
    }
}

/// The stream of device 0's routed server, once it exists (for [`capture`]).
static STREAM: OnceLock<Arc<CudaStream>> = OnceLock::new();

/// A CUDA graph [`capture`] recorded, with the memory allocated while it recorded.
pub struct Captured {
    graph: CudaGraph,
    kept: Vec<(ManagedMemoryHandle, u64)>,
}

// SAFETY: a graph's handles are the driver's, usable from any thread once the context is
// bound (cudarc binds it before launching); `Captured` is used by one thread at a time.
unsafe impl Send for Captured {}

impl Captured {
    /// Bytes of memory the graph holds: what its recording allocated.
    pub fn kept_bytes(&self) -> u64 {
        self.kept.iter().map(|(_, bytes)| bytes).sum()
    }
}

/// Records the kernels `record` launches through `client` (device 0's [`KilnCuda`]) into a
/// CUDA graph on kiln's stream, without running them ([`replay`] runs them), and keeps what
/// `record` allocates. `record` may only launch kernels (module docs); its value is
/// returned beside the graph.
pub fn capture<T, E: std::fmt::Display>(
    client: &ComputeClient<KilnCuda>,
    record: impl FnOnce() -> Result<T, E>,
) -> Result<(Captured, T), LaunchError> {
    let stream = stream_after(client)?;
    *server::KEPT.lock().expect("kept allocations") = Some(Vec::new());
    let mut value = None;
    let graph = capture_on(stream, |_| {
        value = Some(record().map_err(|e| LaunchError::Unsupported(e.to_string()))?);
        // The server thread has run all of it (into the capture) once this returns.
        (client.flush()).map_err(|e| LaunchError::Unsupported(format!("the captured work: {e}")))
    });
    let kept = (server::KEPT.lock().expect("kept allocations").take()).unwrap_or_default();
    let captured = Captured {
        graph: graph?,
        kept,
    };
    Ok((captured, value.expect("recorded")))
}

/// Kiln's stream, once everything `client` issued before the call is on it (the client's
/// server thread launches asynchronously: it is flushed first).
fn stream_after(client: &ComputeClient<KilnCuda>) -> Result<&'static Arc<CudaStream>, LaunchError> {
    (client.flush()).map_err(|e| LaunchError::Unsupported(format!("flushing the client: {e}")))?;
    STREAM
        .get()
        .ok_or_else(|| LaunchError::Unsupported("no routed CUDA server".into()))
}

/// Runs `graph` on kiln's stream after everything `client` issued before the call, and
/// before what it issues after.
pub fn replay(client: &ComputeClient<KilnCuda>, captured: &Captured) -> Result<(), LaunchError> {
    stream_after(client)?;
    Ok(captured.graph.launch()?)
}

/// Where an array lives on the device, resolved once: what [`write_all`] writes to without
/// asking CubeCL's server thread for the address again. Holds the array, so the address
/// stays its.
pub struct Target<T> {
    array: DeviceArray<T>,
    address: u64,
}

impl<T: CubeElement> Target<T> {
    /// `array`'s target (a round trip to the client's server thread).
    pub fn of(
        client: &ComputeClient<KilnCuda>,
        array: &DeviceArray<T>,
    ) -> Result<Self, LaunchError> {
        let address = (client.get_resource(array.handle().clone()))
            .map_err(|e| LaunchError::Unsupported(format!("the array's address: {e}")))?
            .resource()
            .ptr;
        Ok(Target {
            array: array.clone(),
            address,
        })
    }
}

/// Writes each `data` over the start of its target in place, in order on kiln's stream
/// (after what `client` issued before, before what it issues after): how a graph's inputs
/// change between replays, since a capture holds no copies. The host data is staged by
/// the driver before this returns.
pub fn write_all<T: CubePrimitive + CubeElement>(
    client: &ComputeClient<KilnCuda>,
    writes: &[(&Target<T>, &[T])],
) -> Result<(), LaunchError> {
    if let Some((target, data)) = writes.iter().find(|(t, d)| d.len() > t.array.len()) {
        return Err(LaunchError::Unsupported(format!(
            "{} values written into an array of {}",
            data.len(),
            target.array.len()
        )));
    }
    let stream = stream_after(client)?;
    for (target, data) in writes {
        // SAFETY: the target's address starts its live array (held by the target) of at
        // least `data.len()` elements; the source is pageable, so the driver copies it out
        // before returning.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(target.address, data, stream.cu_stream())
        }?;
    }
    Ok(())
}

/// [`write_all`] into one array, its address resolved for this write.
pub fn write<T: CubePrimitive + CubeElement>(
    client: &ComputeClient<KilnCuda>,
    array: &DeviceArray<T>,
    data: &[T],
) -> Result<(), LaunchError> {
    write_all(client, &[(&Target::of(client, array)?, data)])
}
