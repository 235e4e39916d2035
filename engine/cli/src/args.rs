//! Flags shared by the subcommands that run the model, and the command line's names for
//! the engine's choices (the library's types carry no `clap`).
use clap::{Args, ValueEnum};
use kiln::cache::CacheKind;
use kiln_backends::{BackendError, BackendKind};
use kiln_kernels::mla::KvFormat;
use kiln_kernels::Precision;

/// How `serve` and `generate` run the model: the backend, the KV cache's storage and what
/// the kernels may round.
#[derive(Args)]
pub struct DeviceArgs {
    /// KV cache storage: bf16, or fp8 (FlashMLA's layout, ~57% of the bytes).
    #[arg(long, value_enum, default_value_t = KvDtype::Bf16)]
    pub kv_cache_dtype: KvDtype,
    /// Kernel precision: bf16 (tensor cores) or exact (f32 operands, slower).
    #[arg(long, value_enum, default_value_t = PrecisionArg::Bf16)]
    pub precision: PrecisionArg,
    /// Backend: wgpu, cuda or cuda-routed (CUDA with every kernel launched by kiln on its own stream) (default: KILN_BACKEND, else CUDA when compiled in).
    #[arg(long)]
    pub backend: Option<String>,
}

impl DeviceArgs {
    /// The backend these flags (or KILN_BACKEND) choose.
    pub fn backend(&self) -> Result<BackendKind, BackendError> {
        BackendKind::choose(self.backend.as_deref())
    }
}

/// `--kv-cache-dtype`: how KV rows are stored.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum KvDtype {
    /// f32 rows (exact; for checks).
    F32,
    /// bf16 rows.
    Bf16,
    /// FlashMLA's fp8 rows (E4M3 latent with per-128 scales, bf16 rope part).
    Fp8,
}

impl From<KvDtype> for KvFormat {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => KvFormat::F32,
            KvDtype::Bf16 => KvFormat::Bf16,
            KvDtype::Fp8 => KvFormat::Fp8,
        }
    }
}

/// `--precision`: what the GEMM and attention kernels may round.
#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum PrecisionArg {
    /// Tensor cores where the device has them (bf16 operands, f32 accumulation).
    #[default]
    Bf16,
    /// f32 operands everywhere (no tensor cores): slower; matches an f32 model within
    /// bf16 rounding, for checking outputs.
    Exact,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Exact => Precision::Exact,
        }
    }
}

/// `--prefix-cache`: which prefix cache the engine runs.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum PrefixCacheArg {
    /// The radix tree (default).
    Radix,
    /// The flat list: the naive oracle, linear in the cache's size.
    Flat,
}

impl From<PrefixCacheArg> for CacheKind {
    fn from(c: PrefixCacheArg) -> Self {
        match c {
            PrefixCacheArg::Radix => CacheKind::Radix,
            PrefixCacheArg::Flat => CacheKind::Flat,
        }
    }
}
