//! One module per subcommand.
pub mod bench;
pub mod check;
pub mod generate;
pub mod info;
pub mod route;
pub mod serve;

use kiln_kernels::mla::KvFormat;

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
