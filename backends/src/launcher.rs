//! kiln's own CUDA launcher (issue 29): kernels still written once in CubeCL, compiled from
//! the CUDA C++ CubeCL generates for them ([`kiln_kernels::cuda_source`]) by NVRTC, loaded
//! and launched through cudarc on a stream kiln owns, so that a step's launches can be
//! captured as a CUDA graph and replayed. (CubeCL 0.10 launches on streams of its own that
//! nothing outside it reaches, so its launches cannot be captured.)
//!
//! A launch passes what CubeCL's CUDA runtime passes (cubecl-cuda 0.10,
//! `CudaServer::launch_checked` and `execute_task`): each array's device address, in the
//! kernel's parameter order, then the info struct by value (`__grid_constant__`: the
//! scalars grouped by type, then each array's buffer length and length), built by CubeCL's
//! own [`InfoBuilder`]. A kernel whose info spills into dynamic metadata is refused.
//!
//! The buffers are CubeCL's (the weights, the KV pool, step buffers): their addresses are
//! read when a launch's arguments are built, and the buffers must outlive every launch and
//! captured graph that uses them. The two streams are ordered by the caller: CubeCL's work
//! synchronised before kiln's stream reads what it wrote, kiln's stream synchronised before
//! CubeCL reads what kiln's wrote.
//!
//! Not yet run on a GPU: `tests/tests/conformance/launcher.rs` is the check (a kernel
//! launched here equals CubeCL's launch bit for bit, and so does its replayed graph).
use std::ffi::c_void;
use std::sync::Arc;

use cubecl::cuda::{install, CudaRuntime};
use cubecl::prelude::*;
use cubecl::{InfoBuilder, ScalarArgType};
pub use cudarc::driver::CudaGraph;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use kiln_kernels::cuda_source::CudaSource;
use kiln_kernels::DeviceArray;

/// Why a kernel could not be compiled, loaded or launched.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("NVRTC rejected {kernel}: {log}")]
    Compile { kernel: String, log: String },
    #[error("CUDA: {0}")]
    Driver(#[from] DriverError),
    #[error("{0}")]
    Unsupported(String),
}

/// NVRTC's target for compute capability `major.minor`: the arch-specific one (`sm_90a`)
/// from Hopper on, as CubeCL's runtime compiles. Leaked once per launcher: cudarc's
/// options take a `'static` name.
fn target(major: i32, minor: i32) -> &'static str {
    let name = match major >= 9 {
        true => format!("sm_{major}{minor}a"),
        false => format!("sm_{major}{minor}"),
    };
    Box::leak(name.into_boxed_str())
}

/// Device 0's primary context (the one CubeCL uses), its target, and a stream of kiln's.
pub struct Launcher {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    target: &'static str,
    arch: u32,
}

impl Launcher {
    pub fn new() -> Result<Self, LaunchError> {
        let context = CudaContext::new(0)?;
        let (major, minor) = context.compute_capability()?;
        let stream = context.new_stream()?;
        Ok(Launcher {
            context,
            stream,
            target: target(major, minor),
            arch: (major * 10 + minor) as u32,
        })
    }

    /// The device's compute capability as `major * 10 + minor`.
    pub fn arch(&self) -> u32 {
        self.arch
    }

    /// kiln's stream: launches go here, and so do captures.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Captures what `record` launches on kiln's stream into a CUDA graph, to replay with
    /// [`CudaGraph::launch`] ([`capture_on`]).
    pub fn capture(
        &self,
        record: impl FnOnce(&CudaStream) -> Result<(), LaunchError>,
    ) -> Result<CudaGraph, LaunchError> {
        capture_on(&self.stream, record)
    }

    /// Compiles `source` for this device as CubeCL's runtime would (NVRTC, the arch-specific
    /// target, the CUDA headers, line info) and loads its entry point.
    pub fn load(&self, source: &CudaSource) -> Result<Kernel, LaunchError> {
        // The CUDA headers, found as CubeCL's runtime finds them.
        let include_paths = [install::include_path(), install::cccl_include_path()]
            .iter()
            .filter(|dir| dir.is_dir())
            .map(|dir| dir.display().to_string())
            .collect();
        let options = CompileOptions {
            arch: Some(self.target),
            include_paths,
            options: vec!["-lineinfo".into()],
            ..Default::default()
        };
        let ptx =
            compile_ptx_with_opts(&source.text, options).map_err(|e| LaunchError::Compile {
                kernel: source.entry.clone(),
                log: e.to_string(),
            })?;
        let function = self
            .context
            .load_module(ptx)?
            .load_function(&source.entry)?;
        function.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            source.shared_bytes as i32,
        )?;
        Ok(Kernel {
            function,
            cube_dim: source.cube_dim,
            shared_bytes: source.shared_bytes as u32,
        })
    }
}

/// Captures what `record` launches on `stream` into a CUDA graph (relaxed mode: CubeCL's
/// threads may call CUDA meanwhile); the capture ends even where `record` fails.
pub fn capture_on(
    stream: &Arc<CudaStream>,
    record: impl FnOnce(&CudaStream) -> Result<(), LaunchError>,
) -> Result<CudaGraph, LaunchError> {
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let recorded = record(stream);
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    recorded?;
    graph?.ok_or_else(|| LaunchError::Unsupported("a capture of no work".into()))
}

/// A launch's arguments, in the kernel's parameter order.
#[derive(Default)]
pub struct Args {
    addresses: Vec<u64>,
    info: InfoBuilder,
}

impl Args {
    /// The next parameter: an array over `a` (its address read from CubeCL).
    pub fn array<T: CubePrimitive + CubeElement>(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        a: &DeviceArray<T>,
    ) -> &mut Self {
        let resource = client
            .get_resource(a.handle().clone())
            .expect("a live CubeCL buffer");
        self.addresses.push(resource.resource().ptr);
        let elem = std::mem::size_of::<T>() as u64;
        let buffer_len = a.handle().size_in_used() / elem;
        (self.info.metadata).register_array(buffer_len, a.len() as u64, AddressType::U32);
        self
    }

    /// The next parameter: a scalar.
    pub fn scalar<T: ScalarArgType>(&mut self, value: T) -> &mut Self {
        self.info.scalars.push(value);
        self
    }
}

/// A kernel loaded by a [`Launcher`].
pub struct Kernel {
    function: CudaFunction,
    cube_dim: CubeDim,
    shared_bytes: u32,
}

impl Kernel {
    /// Launches the kernel on `stream` over `cubes` with `args`.
    ///
    /// # Safety
    /// The arguments are the kernel's parameters, in order, and its arrays hold what it
    /// reads and writes at this launch.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        cubes: (u32, u32, u32),
        mut args: Args,
    ) -> Result<(), LaunchError> {
        let info = args.info.finish(AddressType::U32);
        if info.dynamic_metadata_offset < info.data.len() {
            return Err(LaunchError::Unsupported(
                "a kernel whose info spills into dynamic metadata".into(),
            ));
        }
        // SAFETY: the caller vouches for the arguments.
        unsafe { self.launch_raw(stream, cubes, &mut args.addresses, &info.data) }
    }

    /// Launches the kernel with its parameters as they are passed: each array's device
    /// address, then the info words (passed by value; none if empty).
    ///
    /// # Safety
    /// As [`Self::launch`]: `addresses` and `info` are this launch's, in the kernel's order.
    pub unsafe fn launch_raw(
        &self,
        stream: &CudaStream,
        cubes: (u32, u32, u32),
        addresses: &mut [u64],
        info: &[u64],
    ) -> Result<(), LaunchError> {
        let mut params: Vec<*mut c_void> = (addresses.iter_mut())
            .map(|address| address as *mut u64 as *mut c_void)
            .collect();
        if !info.is_empty() {
            params.push(info.as_ptr() as *mut c_void);
        }
        let d = self.cube_dim;
        // SAFETY: the caller vouches for the arguments; `params` and the info outlive the
        // call (the driver copies them at launch, and at capture into the graph).
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.function.cu_function(),
                cubes,
                (d.x, d.y, d.z),
                self.shared_bytes,
                stream.cu_stream(),
                &mut params,
            )?;
        }
        Ok(())
    }
}
