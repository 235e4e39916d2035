//! NVRTC, CUDA's runtime compiler, on a machine without a GPU or a CUDA toolkit: kernels'
//! generated CUDA C++ compiled to cubins for chosen targets (ptxas runs inside NVRTC), so
//! CI checks that the tensor-core paths of GPUs it does not have still compile.
//!
//! NVRTC is found in `$CUDA_HOME` (else `/usr/local/cuda`) where a toolkit is installed,
//! else in the Python environment, where `.ci/setup` installs NVIDIA's wheels (NVRTC and the
//! headers CubeCL's source includes). It is loaded by path here, and then reached through
//! cudarc, which finds the loaded library by its name.
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use cudarc::nvrtc::{result, sys};

/// NVRTC, loaded, and the include directories CubeCL's source needs.
pub struct Nvrtc {
    includes: Vec<PathBuf>,
}

/// Where the Python environment keeps its packages (`None` without `python3`).
fn python_packages() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// A CUDA root (`lib` and `include` below it) and its NVRTC library, if it has one.
fn nvrtc_in(root: &Path, libs: &[&str]) -> Option<(PathBuf, PathBuf)> {
    (libs.iter())
        .map(|lib| root.join(lib))
        .find(|lib| lib.is_file())
        .map(|lib| (lib, root.join("include")))
}

impl Nvrtc {
    /// NVRTC from a CUDA toolkit or NVIDIA's Python wheels; loaded once per process.
    pub fn get() -> Result<&'static Nvrtc, String> {
        static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
        NVRTC.get_or_init(Self::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Nvrtc, String> {
        let toolkit = std::env::var_os("CUDA_HOME").map_or("/usr/local/cuda".into(), PathBuf::from);
        let wheels = python_packages().map(|p| p.join("nvidia/cu13"));
        let (lib, include) = nvrtc_in(&toolkit, &["lib64/libnvrtc.so", "lib/libnvrtc.so"])
            .or_else(|| wheels.and_then(|w| nvrtc_in(&w, &["lib/libnvrtc.so.13"])))
            .ok_or(
                "no NVRTC: no CUDA toolkit ($CUDA_HOME, /usr/local/cuda) and no NVIDIA \
                    wheels in python3's packages (.ci/setup installs nvidia-cuda-nvrtc)",
            )?;
        // SAFETY: NVRTC's initialisers have no preconditions. The library stays loaded for
        // the process (leaked), so cudarc's own load by name finds it.
        let library = unsafe { libloading::Library::new(&lib) }
            .map_err(|e| format!("loading {}: {e}", lib.display()))?;
        std::mem::forget(library);
        Ok(Nvrtc {
            includes: vec![include.join("cccl"), include],
        })
    }

    /// Compiles `source` for `arch` (`sm_90a`, `sm_100a`, ...): the cubin's size in bytes,
    /// or NVRTC's log (ptxas' complaints included).
    pub fn cubin(&self, source: &str, arch: &str) -> Result<usize, String> {
        let source = CString::new(source).expect("no NUL in CUDA source");
        let mut options = vec![format!("--gpu-architecture={arch}")];
        options.extend(
            (self.includes.iter())
                .filter(|dir| dir.is_dir())
                .map(|dir| format!("--include-path={}", dir.display())),
        );
        let program = result::create_program(&source, None).map_err(|e| format!("{e:?}"))?;
        // SAFETY: `program` was just created and is destroyed once, below.
        unsafe {
            let compiled = result::compile_program(program, &options);
            let log = result::get_program_log(program).map_err(|e| format!("{e:?}"))?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            let mut size = 0;
            let cubin = compiled.and_then(|()| sys::nvrtcGetCUBINSize(program, &mut size).result());
            result::destroy_program(program).map_err(|e| format!("{e:?}"))?;
            match cubin {
                Ok(()) if size > 0 => Ok(size),
                _ => Err(log),
            }
        }
    }
}
