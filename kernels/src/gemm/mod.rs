//! GEMM with the weight format as a compile-time parameter:
//! `C[M, N] = A[M, K] x W[N, K]^T`, `A` in f32 or bf16, f32 accumulation, `W` in
//! - NVFP4 (ModelOpt convention): E2M1 codes packed two per byte (low nibble = even
//!   element), one E4M3 scale per 16 consecutive elements along K, one f32 global scale per
//!   matrix; `w = e2m1 * scale * global_scale`, evaluated in that order so the product is
//!   bit-exact with `kiln_reference::nvfp4`. Neither sm_90 nor wgpu has FP4 arithmetic, so
//!   codes and scales are decoded in registers. On devices with bf16 tensor cores the codes
//!   and scales are re-laid out at load time in the MMA's fragment order ([`fragments`]);
//! - bf16: the attention, dense-MLP, shared-expert and lm_head projections.
//!
//! The grouped variant serves MoE: the rows of `A` are ordered by expert and
//! `expert_offsets[e]..expert_offsets[e + 1]` are expert `e`'s rows; the offsets are read on
//! the device (no host sync), so a decode step that routes on the device can call it.
//!
//! Four kernels ([`GemmPath`] says which one a GEMM runs):
//! - `gemv` (CUDA tensor cores) for decode: dense `M <= 16`, grouped while the experts
//!   average up to 32 rows, NVFP4 in the fragment layout or bf16 with `K % 64 == 0`: weights
//!   straight from global memory into MMA fragments, a cube per run of one expert's rows so
//!   only touched experts are read;
//! - [`skinny`] for decode elsewhere (`K % 32 == 0` for NVFP4, `K % 8 == 0` for bf16): a
//!   bandwidth-oriented GEMV with coalesced 16-byte weight loads, decode in registers and a
//!   cube-level reduction;
//! - `mma` (CUDA tensor cores, `K % 64 == 0`) for larger M and for the grouped GEMM:
//!   64 x 128 tiles, weights decoded into shared memory as bf16, `mma.sync` on bf16
//!   operands;
//! - the correct-first kernel (one unit per output element) for everything else (wgpu).
pub mod fragments;
mod gemv;
mod kernel;
mod mma;
mod skinny;
mod weights;

use cubecl::prelude::*;

pub use fragments::Nvfp4Layout;
pub use weights::{nvfp4_layout, Bf16Weights, Nvfp4Weights};

use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError, Precision};

/// Elements per NVFP4 scale block along K.
pub const BLOCK: usize = 16;
/// Units per cube along N.
const CUBE_N: u32 = 64;
/// The largest M the decode (skinny) kernel takes.
pub const SKINNY_MAX_M: usize = 16;
/// The largest M a dense bf16 GEMM sends through the tensor-core GEMV. The kernel takes up to
/// 8 token groups, but past 16 rows bf16 gains nothing over the tiled kernel (0.94-1.16x at
/// 24 rows, 0.4-0.6x at 64, `benches/RESULTS.md`), so dense bf16 GEMMs past 16 rows go tiled.
pub const GEMV_MAX_M: usize = 16;
/// The largest M a dense NVFP4 GEMM (fragment layout) sends through the GEMV: at 24 rows it
/// beats the tiled kernel and its split-K pass at all four Kimi shapes (1.06-1.59x), at 32
/// it wins two and loses two (0.80-1.23x, `benches/RESULTS.md`).
pub const GEMV_MAX_M_NVFP4: usize = 24;
/// The most rows a grouped GEMM sends through the skinny kernel (128 tokens x top-8): at
/// Kimi's shapes it streams the touched experts at 27-33% of copy against the tiled kernel's
/// 11% up to there (`benches/RESULTS.md`).
pub const GROUPED_SKINNY_MAX_M: usize = 1024;

/// How the weight operand is stored (a compile-time parameter of the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    Nvfp4,
    Bf16,
}

/// Dense NVFP4 GEMM: `out[m, n] = sum_k a[m, k] * w[n, k]`. `out` must hold `m * n` f32.
pub fn nvfp4_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Nvfp4Weights,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    if w.experts != 1 {
        return Err(KernelError::Range {
            what: "experts (dense GEMM)",
            value: w.experts,
            min: 1,
            max: 1,
        });
    }
    w.validate()?;
    validate(client, a, m, w.n, w.k, out)?;
    match w.path(client, m, false, precision) {
        GemmPath::Gemv => gemv::launch(client, a, m, Operand::Nvfp4(w), None, None, out),
        GemmPath::Skinny => skinny::launch(client, a, m, Operand::Nvfp4(w), None, out),
        GemmPath::TensorCores => launch_mma(client, a, m, Operand::Nvfp4(w), None, out),
        GemmPath::Portable => launch_nvfp4_unchecked(client, a, m, w, None, out),
    }
    Ok(())
}

/// Grouped (MoE) NVFP4 GEMM: row `r` of `a` uses expert `e` where
/// `expert_offsets[e] <= r < expert_offsets[e + 1]`. The offsets (`experts + 1` values,
/// non-decreasing, first 0, last `m`) live on the device and are trusted.
pub fn nvfp4_grouped_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Nvfp4Weights,
    expert_offsets: &DeviceArray<u32>,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    w.validate()?;
    validate(client, a, m, w.n, w.k, out)?;
    check_len("expert offsets", expert_offsets, w.experts + 1)?;
    let offsets = Some(expert_offsets);
    match w.path(client, m, true, precision) {
        GemmPath::Gemv => gemv::launch(client, a, m, Operand::Nvfp4(w), None, offsets, out),
        GemmPath::Skinny => skinny::launch(client, a, m, Operand::Nvfp4(w), offsets, out),
        GemmPath::TensorCores => launch_mma(client, a, m, Operand::Nvfp4(w), offsets, out),
        GemmPath::Portable => launch_nvfp4_unchecked(client, a, m, w, offsets, out),
    }
    Ok(())
}

/// bf16-weight GEMM: `out[m, n] = sum_k a[m, k] * w[n, k]`.
pub fn bf16_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Bf16Weights,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    if w.experts != 1 {
        return Err(KernelError::Range {
            what: "experts (dense GEMM)",
            value: w.experts,
            min: 1,
            max: 1,
        });
    }
    w.validate()?;
    validate(client, a, m, w.n, w.k, out)?;
    match w.path(client, m, false, precision) {
        GemmPath::Gemv => gemv::launch(client, a, m, Operand::Bf16(w), None, None, out),
        GemmPath::Skinny => skinny::launch(client, a, m, Operand::Bf16(w), None, out),
        GemmPath::TensorCores => launch_mma(client, a, m, Operand::Bf16(w), None, out),
        GemmPath::Portable => launch_bf16_unchecked(client, a, m, w, None, out),
    }
    Ok(())
}

/// Grouped (MoE) GEMM over bf16 experts; offsets as in [`nvfp4_grouped_gemm`].
pub fn bf16_grouped_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Bf16Weights,
    expert_offsets: &DeviceArray<u32>,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    w.validate()?;
    validate(client, a, m, w.n, w.k, out)?;
    check_len("expert offsets", expert_offsets, w.experts + 1)?;
    let offsets = Some(expert_offsets);
    match w.path(client, m, true, precision) {
        GemmPath::Gemv => gemv::launch(client, a, m, Operand::Bf16(w), None, offsets, out),
        GemmPath::Skinny => skinny::launch(client, a, m, Operand::Bf16(w), offsets, out),
        GemmPath::TensorCores => launch_mma(client, a, m, Operand::Bf16(w), offsets, out),
        GemmPath::Portable => launch_bf16_unchecked(client, a, m, w, offsets, out),
    }
    Ok(())
}

fn validate<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    n: usize,
    k: usize,
    out: &DeviceArray<f32>,
) -> Result<(), KernelError> {
    let props = client.properties();
    if !props.supports_type(F::as_type_native_unchecked()) {
        return Err(KernelError::Unsupported {
            feature: format!("activations of type {}", std::any::type_name::<F>()),
            device: R::name(client).to_string(),
        });
    }
    check_index_space("output elements (M x N)", m * n)?;
    check_index_space("activation elements (M x K)", m * k)?;
    let max_m = props.hardware.max_cube_count.0 as usize;
    if m == 0 || m > max_m {
        return Err(KernelError::Range {
            what: "M",
            value: m,
            min: 1,
            max: max_m,
        });
    }
    check_len("activations A", a, m * k)?;
    check_len("output C", out, m * n)
}

/// Launches the NVFP4 GEMM without validation (grouped when `expert_offsets` is given).
/// Trusts that every buffer matches the shapes in `w` and `m`, that `k % 16 == 0` and that
/// the offsets are well formed.
pub fn launch_nvfp4_unchecked<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Nvfp4Weights,
    expert_offsets: Option<&DeviceArray<u32>>,
    out: &DeviceArray<f32>,
) {
    // A dense launch never reads the offsets slot; the packed weights (also u32) bind it.
    let offsets = expert_offsets.unwrap_or(&w.packed);
    // SAFETY: the caller guarantees the buffers match the shapes passed as scalars; the
    // kernel reads the f32 global scales through their bits.
    unsafe {
        kernel::gemm_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(m as u32, (w.n as u32).div_ceil(CUBE_N), 1),
            CubeDim::new_1d(CUBE_N),
            a.arg(),
            w.packed.arg(),
            w.scales.arg(),
            w.global_scales.arg(),
            offsets.arg(),
            out.arg(),
            w.n as u32,
            w.k as u32,
            w.experts as u32,
            expert_offsets.is_some(),
            WeightFormat::Nvfp4,
        )
    }
}

/// Launches the bf16 GEMM without validation (grouped when `expert_offsets` is given):
/// trusts the buffers to match `w` and `m` and the offsets to be well formed.
pub fn launch_bf16_unchecked<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: &Bf16Weights,
    expert_offsets: Option<&DeviceArray<u32>>,
    out: &DeviceArray<f32>,
) {
    let offsets = expert_offsets.unwrap_or(&w.data);
    // SAFETY: as above; the scale slots (and a dense launch's offsets slot) are bound to the
    // weights and never read.
    unsafe {
        kernel::gemm_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(m as u32, (w.n as u32).div_ceil(CUBE_N), 1),
            CubeDim::new_1d(CUBE_N),
            a.arg(),
            w.data.arg(),
            w.data.arg(),
            w.data.arg(),
            offsets.arg(),
            out.arg(),
            w.n as u32,
            w.k as u32,
            w.experts as u32,
            expert_offsets.is_some(),
            WeightFormat::Bf16,
        )
    }
}

/// Which kernel a GEMM runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// The tensor-core decode GEMM (CUDA; rounds activations to bf16).
    Gemv,
    /// The decode GEMV elsewhere ([`takes_skinny`], [`takes_grouped_skinny`]).
    Skinny,
    /// The tiled tensor-core kernel (CUDA; rounds activations to bf16).
    TensorCores,
    /// The one-unit-per-output kernel (everywhere else).
    Portable,
}

impl GemmPath {
    /// True when the kernel rounds the activations to bf16 (the tensor-core paths).
    pub fn rounds_activations(self) -> bool {
        matches!(self, GemmPath::Gemv | GemmPath::TensorCores)
    }
}

/// The kernel an `m x n x k` GEMM (grouped or dense; NVFP4 in the fragment layout when
/// `fragments`) runs on this device; the public launches dispatch on it, and tests read it
/// (through the weights' `path`) to know which rounding to expect.
#[allow(clippy::too_many_arguments)]
fn gemm_path<R: Runtime>(
    client: &ComputeClient<R>,
    m: usize,
    n: usize,
    k: usize,
    format: WeightFormat,
    fragments: bool,
    experts: Option<usize>,
    precision: Precision,
) -> GemmPath {
    let grouped = experts.is_some();
    let skinny = if grouped {
        takes_grouped_skinny(m, k, n, format)
    } else {
        takes_skinny(m, k, format)
    };
    let tensor_cores = precision == Precision::Bf16 && uses_tensor_cores(client, k);
    let gemv_weights = fragments || (format == WeightFormat::Bf16 && tensor_cores);
    let gemv_rows = if let Some(experts) = experts {
        m <= gemv::GROUPED_GROUPS * 8 * experts && m <= 65_535 && n <= 65_535
    } else if format == WeightFormat::Nvfp4 {
        m <= GEMV_MAX_M_NVFP4
    } else {
        m <= GEMV_MAX_M
    };
    if gemv_weights && gemv_rows {
        GemmPath::Gemv
    } else if skinny && !fragments {
        GemmPath::Skinny
    } else if tensor_cores {
        GemmPath::TensorCores
    } else {
        GemmPath::Portable
    }
}

/// True when a GEMM with rows of `k` elements that is not skinny runs on the tensor cores:
/// `k % 64 == 0` on a device with bf16 `mma.sync m16n8k16`, `ldmatrix` and plane sums.
/// That path rounds the activations to bf16 (see `mma.rs`).
fn uses_tensor_cores<R: Runtime>(client: &ComputeClient<R>, k: usize) -> bool {
    k.is_multiple_of(mma::BK as usize) && crate::tensor_cores::has_bf16_mma(client)
}

/// A weight operand in either format: what the launches below take, and what
/// [`gated_gemm`] pairs.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    Nvfp4(&'a Nvfp4Weights),
    Bf16(&'a Bf16Weights),
}

impl Operand<'_> {
    /// `out[m, n] = a[m, k] w^T`: [`nvfp4_gemm`] and friends, grouped over experts when
    /// `expert_offsets` is given.
    pub fn gemm<R: Runtime, F: Float + CubeElement>(
        &self,
        client: &ComputeClient<R>,
        a: &DeviceArray<F>,
        m: usize,
        expert_offsets: Option<&DeviceArray<u32>>,
        out: &DeviceArray<f32>,
        precision: Precision,
    ) -> Result<(), KernelError> {
        match (*self, expert_offsets) {
            (Operand::Nvfp4(w), None) => nvfp4_gemm(client, a, m, w, out, precision),
            (Operand::Nvfp4(w), Some(o)) => nvfp4_grouped_gemm(client, a, m, w, o, out, precision),
            (Operand::Bf16(w), None) => bf16_gemm(client, a, m, w, out, precision),
            (Operand::Bf16(w), Some(o)) => bf16_grouped_gemm(client, a, m, w, o, out, precision),
        }
    }

    /// The kernel an `m`-row GEMM over these weights runs.
    pub fn path<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        m: usize,
        grouped: bool,
        precision: Precision,
    ) -> GemmPath {
        match self {
            Operand::Nvfp4(w) => w.path(client, m, grouped, precision),
            Operand::Bf16(w) => w.path(client, m, grouped, precision),
        }
    }

    fn validate(&self) -> Result<(), KernelError> {
        match self {
            Operand::Nvfp4(w) => w.validate(),
            Operand::Bf16(w) => w.validate(),
        }
    }

    /// Format, layout, experts, N and K, for comparing a gate with its up.
    fn signature(&self) -> (WeightFormat, Option<Nvfp4Layout>, usize, usize, usize) {
        match self {
            Operand::Nvfp4(w) => (WeightFormat::Nvfp4, Some(w.layout), w.experts, w.n, w.k),
            Operand::Bf16(w) => (WeightFormat::Bf16, None, w.experts, w.n, w.k),
        }
    }
}

/// SwiGLU over a gate and an up projection of the same format, layout and shape:
/// `out[m, n] = silu(a gate^T) * (a up^T)` (`silu(x) = x / (1 + e^-x)`, in f32), grouped
/// (MoE) when `expert_offsets` is given. Where the tensor-core GEMV takes the shape (CUDA
/// decode) one launch reads both weights and writes the activation (each cube reduces 16
/// rows of the gate and the same 16 of the up); elsewhere it runs the two GEMMs into
/// scratch and [`silu_mul`](crate::activation::silu_mul).
#[allow(clippy::too_many_arguments)]
pub fn gated_gemm<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    gate: Operand<'_>,
    up: Operand<'_>,
    expert_offsets: Option<&DeviceArray<u32>>,
    out: &DeviceArray<f32>,
    precision: Precision,
) -> Result<(), KernelError> {
    let (_, _, experts, n, k) = gate.signature();
    if up.signature() != gate.signature() {
        return Err(KernelError::Mismatch {
            what: "gate and up weights (format, layout, experts, N, K)",
            detail: format!("{:?} against {:?}", gate.signature(), up.signature()),
        });
    }
    // Before any scratch is sized from `m`.
    validate(client, a, m, n, k, out)?;
    let grouped = expert_offsets.is_some();
    if gate.path(client, m, grouped, precision) != GemmPath::Gemv {
        let gate_out = DeviceArray::<f32>::uninit(client, m * n);
        let up_out = DeviceArray::<f32>::uninit(client, m * n);
        gate.gemm(client, a, m, expert_offsets, &gate_out, precision)?;
        up.gemm(client, a, m, expert_offsets, &up_out, precision)?;
        return crate::activation::silu_mul(client, &gate_out, &up_out, out);
    }
    gate.validate()?;
    up.validate()?;
    if !grouped && experts != 1 {
        return Err(KernelError::Range {
            what: "experts (dense GEMM)",
            value: experts,
            min: 1,
            max: 1,
        });
    }
    if let Some(offsets) = expert_offsets {
        check_len("expert offsets", offsets, experts + 1)?;
    }
    gemv::launch(client, a, m, gate, Some(up), expert_offsets, out);
    Ok(())
}

/// An operand's buffers and shape as the kernels bind them: bf16 weights bind their words to
/// the scale slots, which their kernels never read.
pub(super) struct OperandBuffers<'a, R: Runtime> {
    pub data: &'a DeviceArray<u32>,
    pub scales: &'a DeviceArray<u32>,
    /// The f32 global scales, read through their bits.
    pub globals: ArrayArg<R>,
    pub format: WeightFormat,
    pub experts: usize,
    pub n: usize,
    pub k: usize,
}

impl<'a> Operand<'a> {
    pub(super) fn buffers<R: Runtime>(&self) -> OperandBuffers<'a, R> {
        match *self {
            Operand::Nvfp4(w) => OperandBuffers {
                data: &w.packed,
                scales: &w.scales,
                globals: w.global_scales.arg(),
                format: WeightFormat::Nvfp4,
                experts: w.experts,
                n: w.n,
                k: w.k,
            },
            Operand::Bf16(w) => OperandBuffers {
                data: &w.data,
                scales: &w.data,
                globals: w.data.arg(),
                format: WeightFormat::Bf16,
                experts: w.experts,
                n: w.n,
                k: w.k,
            },
        }
    }
}

/// Launches the tensor-core GEMM (grouped when `expert_offsets` is given). Trusts
/// validated shapes and `k % 64 == 0`.
fn launch_mma<R: Runtime, F: Float + CubeElement>(
    client: &ComputeClient<R>,
    a: &DeviceArray<F>,
    m: usize,
    w: Operand<'_>,
    expert_offsets: Option<&DeviceArray<u32>>,
    out: &DeviceArray<f32>,
) {
    let fragments = matches!(w, Operand::Nvfp4(w) if w.layout == Nvfp4Layout::Fragments);
    let OperandBuffers {
        data,
        scales,
        globals,
        format,
        experts,
        n,
        k,
    } = w.buffers();
    let m_tiles = (m as u32).div_ceil(mma::BM)
        + if expert_offsets.is_some() {
            experts as u32
        } else {
            0
        };
    let n_tiles = (n as u32).div_ceil(mma::BN);
    // Dense GEMMs with too few tiles to fill the SMs split K (>= 8 steps per split); the
    // splits write `splits` slices of a scratch buffer that one more launch sums (no
    // atomics: the result does not depend on the order the splits finish).
    let sms = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(1);
    let splits = if expert_offsets.is_some() || n % 4 != 0 {
        1
    } else {
        (2 * sms)
            .div_ceil(m_tiles * n_tiles)
            .min(k as u32 / mma::BK / 8)
            .max(1)
    };
    let scratch = (splits > 1).then(|| DeviceArray::<f32>::uninit(client, splits as usize * m * n));
    let offsets = expert_offsets.unwrap_or(data);
    // SAFETY: validated shapes; the weight words bind every slot the format does not read;
    // `m * n % 4 == 0` when splitting (n % 4 == 0).
    unsafe {
        mma::mma_gemm_kernel::launch_unchecked::<F, R>(
            client,
            CubeCount::Static(m_tiles, n_tiles, splits),
            CubeDim::new_1d(mma::UNITS),
            a.arg(),
            data.arg(),
            scales.arg(),
            globals,
            offsets.arg(),
            scratch.as_ref().unwrap_or(out).arg(),
            m as u32,
            n as u32,
            k as u32,
            experts as u32,
            expert_offsets.is_some(),
            format,
            fragments,
        );
        if let Some(scratch) = &scratch {
            let len4 = (m * n / 4) as u32;
            let cubes = len4.div_ceil(256);
            let x = cubes.min(65_535);
            mma::sum_splits_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(x, cubes.div_ceil(x), 1),
                CubeDim::new_1d(256),
                scratch.arg(),
                out.arg(),
                len4,
                splits,
            );
        }
    }
}

/// True when a dense GEMM of this shape takes the decode (skinny) kernel: `M <= 16` and rows
/// of whole 16-byte weight vectors (32 NVFP4 codes, 8 bf16 values).
pub fn takes_skinny(m: usize, k: usize, format: WeightFormat) -> bool {
    let vector_elems = match format {
        WeightFormat::Nvfp4 => 32,
        WeightFormat::Bf16 => 8,
    };
    m <= SKINNY_MAX_M && k.is_multiple_of(vector_elems)
}

/// True when a grouped (MoE) GEMM takes the skinny kernel: decode-sized (`M <= 1024` rows:
/// up to 128 tokens x top-8), rows of whole 16-byte weight vectors, and N in one grid row.
pub fn takes_grouped_skinny(m: usize, k: usize, n: usize, format: WeightFormat) -> bool {
    m <= GROUPED_SKINNY_MAX_M && takes_skinny(1, k, format) && n <= 65_535
}
