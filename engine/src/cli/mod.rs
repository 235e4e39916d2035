//! One module per subcommand.
pub mod bench;
pub mod check;
pub mod generate;
pub mod info;
pub mod route;
pub mod serve;

use kiln_kernels::mla::KvFormat;
use kiln_kernels::Precision;

/// `--kv-cache-dtype`: how KV rows are stored.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
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
#[derive(Clone, Copy, Debug, Default, clap::ValueEnum)]
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
