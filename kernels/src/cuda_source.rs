//! A kernel's CUDA C++ as CubeCL 0.10's CUDA runtime hands it to NVRTC, generated on the
//! host (no device, no driver): for compile checks on targets not at hand (Blackwell here,
//! Hopper in CI), and for kiln's own launcher (`kiln_backends::launcher`). The definition is built as CubeCL's launch macro builds it: CUDA's target
//! properties, then the parameters in order ([`input`], [`output`], [`scalar`]) and the
//! kernel's `expand`; then compiled with CubeCL's CUDA compiler
//! (`CppCompiler<CudaDialect<CudaWmmaCompiler>>`) and the options its runtime sets from
//! sm_90 on, unchecked (all of kiln's kernels are `launch_unchecked`). The text does not
//! depend on the target: NVRTC's `--gpu-architecture` does.
use cubecl::ir::{ContiguousElements, MatrixLayout, MmaProperties, TargetProperties};
use cubecl::prelude::*;
use cubecl::Compiler;
use cubecl_cpp::cuda::mma::{contiguous_elements_cuda, CudaWmmaCompiler};
use cubecl_cpp::cuda::CudaDialect;
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

use crate::KernelError;

/// A kernel's CUDA C++ and what launching it takes.
#[derive(Clone, Debug)]
pub struct CudaSource {
    /// The source, as NVRTC takes it.
    pub text: String,
    /// The entry point's name.
    pub entry: String,
    /// The units of a cube (the launch's block).
    pub cube_dim: CubeDim,
    /// Bytes of shared memory a cube takes (dynamic shared memory at launch).
    pub shared_bytes: usize,
}

/// The CUDA C++ of kernel `name` (its entry point) on cubes of `cube_dim`, whose parameters
/// and body `define` registers and expands into the builder.
pub fn cuda_source(
    name: &str,
    cube_dim: CubeDim,
    define: impl FnOnce(&mut KernelBuilder),
) -> Result<CudaSource, KernelError> {
    let mut builder = KernelBuilder::default();
    // CubeCL 0.10's `CudaRuntime::target_properties()`, which needs the `cuda` feature.
    builder.runtime_properties(TargetProperties {
        mma: MmaProperties {
            register_size_bits: 32,
            const_plane_size: 32,
            register_layout_a: MatrixLayout::RowMajor,
            register_layout_b: MatrixLayout::ColMajor,
            register_layout_acc: MatrixLayout::RowMajor,
            register_duplication_a: 1,
            register_duplication_b: 1,
            register_duplication_acc: 1,
            contiguous_elements: ContiguousElements::new(contiguous_elements_cuda),
        },
    });
    let settings = KernelSettings::default()
        .cube_dim(cube_dim)
        .address_type(AddressType::U32)
        .kernel_name(name);
    settings.address_type.register(&mut builder.scope);
    define(&mut builder);
    CppCompiler::<CudaDialect<CudaWmmaCompiler>>::default()
        .compile(
            builder.build(settings),
            &compilation_options(90),
            ExecutionMode::Unchecked,
            AddressType::U32.unsigned_type(),
        )
        .map(|kernel| CudaSource {
            text: kernel.to_string(),
            entry: name.to_string(),
            cube_dim,
            shared_bytes: kernel.shared_memory_size(),
        })
        .map_err(|err| KernelError::Unsupported {
            feature: format!("{name} ({err})"),
            device: "CubeCL's CUDA compiler".into(),
        })
}

/// The options CubeCL 0.10's CUDA runtime compiles with on a device of compute capability
/// `arch` (`major * 10 + minor`; `CudaServer`'s initialisation), for a CUDA 12.8 or newer
/// toolkit: fast math, `__grid_constant__` info from sm_70, fast `tanh` from sm_75,
/// clusters and `elect.sync` from sm_90.
pub fn compilation_options(arch: u32) -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: arch >= 70,
            fast_tanh: arch >= 75,
            clusters: arch >= 90,
            elect_sync: arch >= 90,
            ..Default::default()
        },
    }
}

/// The next parameter, an input array (`&Array<C>`).
pub fn input<C: CubePrimitive>(builder: &mut KernelBuilder) -> NativeExpand<Array<C>> {
    Array::<C>::expand(&ArrayCompilationArg { inplace: None }, builder)
}

/// The next parameter, an output array (`&mut Array<C>`).
pub fn output<C: CubePrimitive>(builder: &mut KernelBuilder) -> NativeExpand<Array<C>> {
    Array::<C>::expand_output(&ArrayCompilationArg { inplace: None }, builder)
}

/// The next parameter, a scalar.
pub fn scalar<C: LaunchArg<CompilationArg = ()>>(builder: &mut KernelBuilder) -> C::ExpandType {
    C::expand(&(), builder)
}
