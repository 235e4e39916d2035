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
//! work may launch kernels only (no copies, reads or syncs: those are not capturable), and
//! the buffers it uses must outlive the graph and stay where they are.
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cubecl::backtrace::BackTrace;
use cubecl::bytes::Bytes;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::future::DynFut;
use cubecl::ir::TargetProperties;
use cubecl::prelude::*;
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, KernelArguments, ProfilingToken, ServerCommunication,
    ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::zspace::{Shape, Strides};
use cubecl::CubeTask;
use cubecl_runtime::allocator::PitchedMemoryLayoutPolicy;
use cubecl_runtime::id::KernelId;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage};
use cubecl_runtime::storage::{ComputeStorage, ManagedResource};
use cudarc::driver::{result, sys, CudaGraph, CudaStream};
use kiln_kernels::cuda_source::{compilation_options, CudaSource};

use crate::launcher::{Kernel, LaunchError, Launcher};

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

/// CubeCL's CUDA server with its launches and copies moved to kiln's stream.
pub struct Routed {
    inner: Inner,
    launcher: Launcher,
    utilities: Arc<ServerUtilities<Routed>>,
    /// Compute capability as `major * 10 + minor`, for CubeCL's compilation options.
    arch: u32,
    kernels: HashMap<KernelId, Kernel>,
    /// Pinned buffers reads stage through, back once their read completed.
    staging: Arc<Mutex<Vec<Pinned>>>,
    /// Bytes CubeCL's pools had reserved when last looked at (a change is waited for).
    reserved: u64,
    errors: Vec<ServerError>,
}

impl std::fmt::Debug for Routed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routed").field("arch", &self.arch).finish()
    }
}

fn server_error(what: &str, err: impl std::fmt::Display) -> ServerError {
    ServerError::Generic {
        reason: format!("{what}: {err}"),
        backtrace: BackTrace::capture(),
    }
}

/// The stream of device 0's routed server, once it exists (for [`capture`]).
static STREAM: OnceLock<Arc<CudaStream>> = OnceLock::new();

/// Records the kernels `record` launches through `client` (device 0's [`KilnCuda`]) into a
/// CUDA graph on kiln's stream, without running them ([`replay`] runs them). `record` may
/// only launch kernels (module docs).
pub fn capture(
    client: &ComputeClient<KilnCuda>,
    record: impl FnOnce() -> Result<(), kiln_kernels::KernelError>,
) -> Result<CudaGraph, LaunchError> {
    let flushed = |what: &str| {
        client
            .flush()
            .map_err(|e| LaunchError::Unsupported(format!("{what}: {e}")))
    };
    // The server exists once the client does; everything issued so far is on the stream.
    flushed("before the capture")?;
    let stream = STREAM
        .get()
        .ok_or_else(|| LaunchError::Unsupported("no routed CUDA server".into()))?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let recorded = record().map_err(|e| LaunchError::Unsupported(e.to_string()));
    // The server thread has launched all of it (into the capture) once this returns.
    let issued = flushed("the captured work");
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded?;
    issued?;
    graph?.ok_or_else(|| LaunchError::Unsupported("a capture of no work".into()))
}

/// Runs `graph` on kiln's stream after everything `client` issued before the call (the
/// client's server thread may not have launched it yet: it is flushed first), and before
/// what it issues after.
pub fn replay(client: &ComputeClient<KilnCuda>, graph: &CudaGraph) -> Result<(), LaunchError> {
    (client.flush()).map_err(|e| LaunchError::Unsupported(format!("before a replay: {e}")))?;
    Ok(graph.launch()?)
}

impl DeviceService for Routed {
    fn init(device_id: DeviceId) -> Self {
        let inner = <Inner as DeviceService>::init(device_id);
        assert_eq!(
            device_id.index_id, 0,
            "kiln's routed CUDA runtime runs on device 0"
        );
        let launcher = Launcher::new().expect("kiln's CUDA launcher on device 0");
        // One server per device and runtime: set once.
        let _ = STREAM.set(launcher.stream().clone());
        let arch = launcher.arch();
        let theirs = ComputeServer::utilities(&inner);
        let utilities = ServerUtilities::new(
            theirs.properties.clone(),
            theirs.logger.clone(),
            (),
            // CubeCL's CUDA server: rows aligned as `cuMemAllocPitch` aligns them.
            PitchedMemoryLayoutPolicy::new(512),
        );
        Routed {
            inner,
            launcher,
            utilities: Arc::new(utilities),
            arch,
            kernels: HashMap::new(),
            staging: Arc::default(),
            reserved: 0,
            errors: Vec::new(),
        }
    }

    fn utilities(&self) -> ServerUtilitiesHandle {
        self.utilities.clone() as ServerUtilitiesHandle
    }
}

impl ServerCommunication for Routed {
    const SERVER_COMM_ENABLED: bool = false;
}

impl Routed {
    fn stream(&self) -> &Arc<CudaStream> {
        self.launcher.stream()
    }

    /// The device address `binding` starts at.
    fn address(&mut self, binding: Binding, stream_id: StreamId) -> Result<u64, ServerError> {
        Ok(self.inner.get_resource(binding, stream_id)?.resource().ptr)
    }

    /// Waits for CubeCL's stream if its pools changed since last looked at: new memory is
    /// allocated, and released memory freed, in its stream's order.
    fn settle_allocations(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        let reserved = self.inner.memory_usage(stream_id)?.bytes_reserved;
        if reserved != self.reserved {
            cubecl::future::block_on(self.inner.sync(stream_id))?;
        }
        self.reserved = reserved;
        Ok(())
    }

    /// Both streams idle: kiln's, then CubeCL's.
    fn sync_both(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        self.stream()
            .synchronize()
            .map_err(|e| server_error("kiln's stream", e))?;
        cubecl::future::block_on(self.inner.sync(stream_id))
    }

    /// The loaded kernel for `task`, compiled on first use as CubeCL's runtime compiles it.
    fn kernel(
        &mut self,
        id: KernelId,
        task: &dyn CubeTask<Compiler>,
        mode: ExecutionMode,
    ) -> Result<&Kernel, ServerError> {
        if !self.kernels.contains_key(&id) {
            let options = compilation_options(self.arch);
            let compiled = task
                .compile(
                    &mut Compiler::default(),
                    &options,
                    mode,
                    task.address_type(),
                )
                .map_err(|e| server_error("CubeCL's CUDA compiler", e))?;
            let shared_bytes = (compiled.repr.as_ref()).map_or(0, |r| r.shared_memory_size());
            let source = CudaSource {
                text: compiled.source,
                entry: compiled.entrypoint_name,
                cube_dim: compiled.cube_dim,
                shared_bytes,
            };
            let kernel =
                (self.launcher.load(&source)).map_err(|e| server_error("kiln's launcher", e))?;
            self.kernels.insert(id.clone(), kernel);
        }
        Ok(&self.kernels[&id])
    }

    fn launch_routed(
        &mut self,
        task: Box<dyn CubeTask<Compiler>>,
        count: (u32, u32, u32),
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        self.settle_allocations(stream_id)?;
        let mut addresses = (bindings.buffers.into_iter())
            .map(|b| self.address(b, stream_id))
            .collect::<Result<Vec<_>, _>>()?;
        let mut id = task.id();
        id.mode(mode);
        let stream = self.launcher.stream().clone();
        let kernel = self.kernel(id, task.as_ref(), mode)?;
        // SAFETY: the addresses are the live buffers CubeCL bound for this launch, in the
        // kernel's parameter order, and the info is the one CubeCL built for it.
        unsafe { kernel.launch_raw(&stream, count, &mut addresses, &bindings.info.data) }
            .map_err(|e| server_error("kiln's launcher", e))
    }

    /// Runs `work` on CubeCL's own stream, ordered after kiln's and before it.
    fn on_cubecl_stream<T>(
        &mut self,
        stream_id: StreamId,
        work: impl FnOnce(&mut Inner) -> T,
    ) -> Result<T, ServerError> {
        self.sync_both(stream_id)?;
        let out = work(&mut self.inner);
        cubecl::future::block_on(self.inner.sync(stream_id))?;
        Ok(out)
    }

    fn record(&mut self, result: Result<(), ServerError>) {
        if let Err(e) = result {
            self.errors.push(e);
        }
    }

    fn take_errors(&mut self) -> Result<(), ServerError> {
        match self.errors.len() {
            0 => Ok(()),
            _ => Err(ServerError::ServerUnhealthy {
                errors: std::mem::take(&mut self.errors),
                backtrace: BackTrace::capture(),
            }),
        }
    }
}

/// Bytes of a contiguous copy of `d`, or `None` where it is strided.
fn contiguous_bytes(d: &CopyDescriptor) -> Option<usize> {
    let mut expected = 1;
    for (&dim, &stride) in d.shape.iter().zip(d.strides.iter()).rev() {
        if dim > 1 && stride != expected {
            return None;
        }
        expected *= dim;
    }
    Some(expected * d.elem_size)
}

/// Page-locked host memory, for reads copied asynchronously.
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned; it is read and written only by whoever holds it.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Self, ServerError> {
        // SAFETY: a fresh host allocation of `len` bytes (flags 0: cached, not write-combined).
        let ptr = unsafe { result::malloc_host(len.max(1), 0) }
            .map_err(|e| server_error("pinned host memory", e))?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            len: len.max(1),
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`, freed once.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

impl ComputeServer for Routed {
    type Kernel = Box<dyn CubeTask<Compiler>>;
    type Info = ();
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Storage = <Inner as ComputeServer>::Storage;

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, stream_id: StreamId) {
        self.inner.initialize_memory(memory, size, stream_id)
    }

    fn logger(&self) -> Arc<cubecl_runtime::logging::ServerLogger> {
        self.inner.logger()
    }

    fn utilities(&self) -> Arc<ServerUtilities<Self>> {
        self.utilities.clone()
    }

    fn read(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> DynFut<Result<Vec<Bytes>, ServerError>> {
        if let Err(e) = self.take_errors() {
            return Box::pin(async { Err(e) });
        }
        if descriptors.iter().any(|d| contiguous_bytes(d).is_none()) {
            return match self
                .on_cubecl_stream(stream_id, |inner| inner.read(descriptors, stream_id))
            {
                Ok(read) => read,
                Err(e) => Box::pin(async { Err(e) }),
            };
        }
        let staged = (|| {
            self.settle_allocations(stream_id)?;
            let mut staged = Vec::with_capacity(descriptors.len());
            for d in descriptors {
                let len = contiguous_bytes(&d).expect("checked above");
                let src = self.address(d.handle, stream_id)?;
                let pinned = {
                    let mut pool = self.staging.lock().expect("staging pool");
                    match pool.iter().position(|p| p.len >= len) {
                        Some(i) => pool.swap_remove(i),
                        None => Pinned::new(len)?,
                    }
                };
                // SAFETY: `pinned` holds at least `len` bytes and stays out of the pool until
                // this read completes; `src` is the live buffer being read.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(pinned.ptr, len);
                    result::memcpy_dtoh_async(dst, src, self.stream().cu_stream())
                }
                .map_err(|e| server_error("read", e))?;
                staged.push((pinned, len));
            }
            let done = (self.stream().record_event(None)).map_err(|e| server_error("read", e))?;
            Ok::<_, ServerError>((staged, done))
        })();
        let pool = self.staging.clone();
        Box::pin(async move {
            let (staged, done) = staged?;
            done.synchronize().map_err(|e| server_error("read", e))?;
            let mut out = Vec::with_capacity(staged.len());
            for (pinned, len) in staged {
                // SAFETY: the copy into `pinned` completed with the event.
                let bytes = unsafe { std::slice::from_raw_parts(pinned.ptr, len) }.to_vec();
                out.push(Bytes::from_bytes_vec(bytes));
                pool.lock().expect("staging pool").push(pinned);
            }
            Ok(out)
        })
    }

    fn write(&mut self, descriptors: Vec<(CopyDescriptor, Bytes)>, stream_id: StreamId) {
        if descriptors
            .iter()
            .any(|(d, _)| contiguous_bytes(d).is_none())
        {
            let done =
                self.on_cubecl_stream(stream_id, |inner| inner.write(descriptors, stream_id));
            return self.record(done);
        }
        let result = (|| {
            self.settle_allocations(stream_id)?;
            for (d, bytes) in descriptors {
                let len = contiguous_bytes(&d)
                    .expect("checked above")
                    .min(bytes.len());
                let dst = self.address(d.handle, stream_id)?;
                // SAFETY: `dst` is the live buffer written, at least `len` bytes. The source
                // is pageable: the driver stages it before returning, so it may be dropped.
                unsafe { result::memcpy_htod_async(dst, &bytes[..len], self.stream().cu_stream()) }
                    .map_err(|e| server_error("write", e))?;
            }
            Ok(())
        })();
        self.record(result)
    }

    fn sync(&mut self, stream_id: StreamId) -> DynFut<Result<(), ServerError>> {
        let result = self.sync_both(stream_id).and_then(|()| self.take_errors());
        Box::pin(async move { result })
    }

    fn get_resource(
        &mut self,
        binding: Binding,
        stream_id: StreamId,
    ) -> Result<ManagedResource<Resource>, ServerError> {
        self.inner.get_resource(binding, stream_id)
    }

    unsafe fn launch(
        &mut self,
        kernel: Self::Kernel,
        count: CubeCount,
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) {
        let info = &bindings.info;
        let routable =
            bindings.tensor_maps.is_empty() && info.dynamic_metadata_offset >= info.data.len();
        let result = match count {
            CubeCount::Static(x, y, z) if routable => {
                self.launch_routed(kernel, (x, y, z), bindings, mode, stream_id)
            }
            // SAFETY: the caller's launch, as it asked for it, on CubeCL's stream.
            count => self.on_cubecl_stream(stream_id, |inner| unsafe {
                inner.launch(kernel, count, bindings, mode, stream_id)
            }),
        };
        self.record(result)
    }

    fn flush(&mut self, stream_id: StreamId) -> Result<(), ServerError> {
        self.inner.flush(stream_id)
    }

    fn memory_usage(&mut self, stream_id: StreamId) -> Result<MemoryUsage, ServerError> {
        self.inner.memory_usage(stream_id)
    }

    fn memory_cleanup(&mut self, stream_id: StreamId) {
        // Freed memory must be idle on kiln's stream too.
        let done = self.on_cubecl_stream(stream_id, |inner| inner.memory_cleanup(stream_id));
        self.record(done);
        self.reserved = 0;
    }

    fn start_profile(&mut self, stream_id: StreamId) -> Result<ProfilingToken, ServerError> {
        self.sync_both(stream_id)?;
        self.inner.start_profile(stream_id)
    }

    fn end_profile(
        &mut self,
        stream_id: StreamId,
        token: ProfilingToken,
    ) -> Result<cubecl::profile::ProfileDuration, cubecl::server::ProfileError> {
        if let Err(e) = self.sync_both(stream_id) {
            return Err(cubecl::server::ProfileError::Unknown {
                reason: e.to_string(),
                backtrace: BackTrace::capture(),
            });
        }
        self.inner.end_profile(stream_id, token)
    }

    fn allocation_mode(&mut self, mode: MemoryAllocationMode, stream_id: StreamId) {
        self.inner.allocation_mode(mode, stream_id)
    }
}
