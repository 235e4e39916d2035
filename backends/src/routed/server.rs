//! [`Routed`]: CubeCL's CUDA server wrapped, its launches and copies on kiln's stream.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cubecl::backtrace::BackTrace;
use cubecl::bytes::Bytes;
use cubecl::device::{DeviceId, DeviceService, ServerUtilitiesHandle};
use cubecl::future::DynFut;
use cubecl::prelude::*;
use cubecl::server::{
    Binding, ComputeServer, CopyDescriptor, KernelArguments, ProfilingToken, ServerCommunication,
    ServerError, ServerUtilities,
};
use cubecl::stream_id::StreamId;
use cubecl::CubeTask;
use cubecl_runtime::allocator::PitchedMemoryLayoutPolicy;
use cubecl_runtime::id::KernelId;
use cubecl_runtime::memory_management::{ManagedMemoryHandle, MemoryAllocationMode, MemoryUsage};
use cubecl_runtime::storage::ManagedResource;
use cudarc::driver::{result, CudaEvent, CudaStream};
use kiln_kernels::cuda_source::{compilation_options, CudaSource};

use super::copies::{contiguous_bytes, Pinned};
use super::{Compiler, Inner, Resource, STREAM};
use crate::launcher::{Kernel, Launcher};

/// While a capture records: every allocation's handle and size, held so that its memory
/// stays the graph's (`super::capture`).
pub(super) static KEPT: Mutex<Option<Vec<(ManagedMemoryHandle, u64)>>> = Mutex::new(None);

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

pub(super) fn server_error(what: &str, err: impl std::fmt::Display) -> ServerError {
    ServerError::Generic {
        reason: format!("{what}: {err}"),
        backtrace: BackTrace::capture(),
    }
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

    /// The device addresses the bindings start at, once CubeCL's stream has settled any
    /// allocation their resolution made ([`Self::settle_allocations`]).
    fn addresses(
        &mut self,
        bindings: impl IntoIterator<Item = Binding>,
        stream_id: StreamId,
    ) -> Result<Vec<u64>, ServerError> {
        let addresses = (bindings.into_iter())
            .map(|b| Ok(self.inner.get_resource(b, stream_id)?.resource().ptr))
            .collect::<Result<Vec<_>, ServerError>>()?;
        self.settle_allocations(stream_id)?;
        Ok(addresses)
    }

    /// Waits for CubeCL's stream if its pools changed since last looked at: new memory is
    /// allocated, and released memory freed, in its stream's order. Called once an
    /// operation's buffers are resolved (a resolution may allocate), before it is issued.
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

    /// Loads `task`'s kernel under `id` on first use, compiled as CubeCL's runtime compiles it.
    fn load(
        &mut self,
        id: &KernelId,
        task: &dyn CubeTask<Compiler>,
        mode: ExecutionMode,
    ) -> Result<(), ServerError> {
        if !self.kernels.contains_key(id) {
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
        Ok(())
    }

    fn launch_routed(
        &mut self,
        task: Box<dyn CubeTask<Compiler>>,
        count: (u32, u32, u32),
        bindings: KernelArguments,
        mode: ExecutionMode,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        let mut addresses = self.addresses(bindings.buffers, stream_id)?;
        let mut id = task.id();
        id.mode(mode);
        self.load(&id, task.as_ref(), mode)?;
        // SAFETY: the addresses are the live buffers CubeCL bound for this launch, in the
        // kernel's parameter order, and the info is the one CubeCL built for it.
        unsafe {
            self.kernels[&id].launch_raw(self.stream(), count, &mut addresses, &bindings.info.data)
        }
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

    /// Enqueues contiguous reads into pinned staging on kiln's stream; the event marks them
    /// done.
    fn stage_reads(
        &mut self,
        descriptors: Vec<CopyDescriptor>,
        stream_id: StreamId,
    ) -> Result<(Vec<(Pinned, usize)>, CudaEvent), ServerError> {
        let lens: Vec<usize> = (descriptors.iter())
            .map(|d| contiguous_bytes(d).expect("contiguous reads only"))
            .collect();
        let sources = self.addresses(descriptors.into_iter().map(|d| d.handle), stream_id)?;
        let mut staged = Vec::with_capacity(sources.len());
        for (src, len) in sources.into_iter().zip(lens) {
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
        Ok((staged, done))
    }

    /// Contiguous writes on kiln's stream, from pageable host memory.
    fn write_routed(
        &mut self,
        descriptors: Vec<(CopyDescriptor, Bytes)>,
        stream_id: StreamId,
    ) -> Result<(), ServerError> {
        let (targets, data): (Vec<_>, Vec<_>) = descriptors.into_iter().unzip();
        let lens: Vec<usize> = (targets.iter())
            .map(|d| contiguous_bytes(d).expect("contiguous writes only"))
            .collect();
        let dsts = self.addresses(targets.into_iter().map(|d| d.handle), stream_id)?;
        for ((dst, bytes), len) in dsts.into_iter().zip(data).zip(lens) {
            let len = len.min(bytes.len());
            // SAFETY: `dst` is the live buffer written, at least `len` bytes. The source is
            // pageable: the driver stages it before returning, so it may be dropped.
            unsafe { result::memcpy_htod_async(dst, &bytes[..len], self.stream().cu_stream()) }
                .map_err(|e| server_error("write", e))?;
        }
        Ok(())
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

impl ComputeServer for Routed {
    type Kernel = Box<dyn CubeTask<Compiler>>;
    type Info = ();
    type MemoryLayoutPolicy = PitchedMemoryLayoutPolicy;
    type Storage = <Inner as ComputeServer>::Storage;

    fn initialize_memory(&mut self, memory: ManagedMemoryHandle, size: u64, stream_id: StreamId) {
        if let Some(kept) = KEPT.lock().expect("kept allocations").as_mut() {
            kept.push((memory.clone(), size));
        }
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
        let staged = self.stage_reads(descriptors, stream_id);
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
        let result = self.write_routed(descriptors, stream_id);
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
