//! The backends kiln can be built with, and how one is chosen at run time.
use std::fmt;
use std::str::FromStr;

/// A kernel backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// Portable: Vulkan, Metal or DX12 through wgpu (llvmpipe in CI).
    Wgpu,
    /// NVIDIA GPUs through CUDA and NVRTC.
    Cuda,
    /// CUDA with every kernel and copy on a stream of kiln's instead of CubeCL's
    /// (`routed::KilnCuda`): the same kernels, launched by kiln's launcher.
    CudaRouted,
}

/// Why a backend cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("unknown backend {0:?} (expected \"wgpu\", \"cuda\" or \"cuda-routed\")")]
    Unknown(String),
    #[error("backend {0} is not compiled into this binary (rebuild with `--features {feature}`)", feature = .0.feature())]
    NotCompiled(BackendKind),
}

impl BackendKind {
    /// Every backend compiled into this binary.
    pub fn compiled() -> Vec<BackendKind> {
        let mut kinds = Vec::new();
        if cfg!(feature = "cuda") {
            kinds.extend([BackendKind::Cuda, BackendKind::CudaRouted]);
        }
        if cfg!(feature = "wgpu") {
            kinds.push(BackendKind::Wgpu);
        }
        kinds
    }

    /// The cargo feature that compiles this backend in.
    pub fn feature(self) -> &'static str {
        match self {
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda | BackendKind::CudaRouted => "cuda",
        }
    }

    /// The backend to use: `requested` if given, else `KILN_BACKEND`, else CUDA when it is
    /// compiled in, else wgpu.
    pub fn choose(requested: Option<&str>) -> Result<BackendKind, BackendError> {
        let from_env = std::env::var("KILN_BACKEND").ok();
        let kind = match requested.or(from_env.as_deref()) {
            Some(name) => name.parse()?,
            None => *Self::compiled()
                .first()
                .ok_or(BackendError::NotCompiled(BackendKind::Wgpu))?,
        };
        if Self::compiled().contains(&kind) {
            Ok(kind)
        } else {
            Err(BackendError::NotCompiled(kind))
        }
    }
}

impl FromStr for BackendKind {
    type Err = BackendError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "wgpu" => Ok(BackendKind::Wgpu),
            "cuda" => Ok(BackendKind::Cuda),
            "cuda-routed" => Ok(BackendKind::CudaRouted),
            other => Err(BackendError::Unknown(other.to_string())),
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
            BackendKind::CudaRouted => "cuda-routed",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_case_insensitively() {
        assert_eq!("CUDA".parse::<BackendKind>().unwrap(), BackendKind::Cuda);
        assert_eq!("wgpu".parse::<BackendKind>().unwrap(), BackendKind::Wgpu);
        let routed = "Cuda-Routed".parse::<BackendKind>().unwrap();
        assert_eq!(
            (routed, routed.to_string()),
            (BackendKind::CudaRouted, "cuda-routed".into())
        );
    }

    #[test]
    fn unknown_names_are_rejected_with_the_name() {
        let err = "metal".parse::<BackendKind>().unwrap_err();
        assert!(err.to_string().contains("metal"));
    }
}
