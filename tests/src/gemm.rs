//! GEMM cases (NVFP4 and bf16 weights, dense and grouped, plain or as a SwiGLU gate/up pair)
//! against `kiln_reference::gemm`.
//!
//! NVFP4 weights are quantized by the reference and the kernel decodes the very same codes;
//! bf16 weights are rounded to bf16 first. Either way the reference multiplies exactly the
//! values the kernel sees; activations are rounded to the activation dtype first. The only
//! error left is f32 accumulation, bounded by `Tolerance::dot(K, f32, f32)` against
//! `sum |a w|`, and for a SwiGLU pair that bound carried through `silu(gate) * up`
//! (`swiglu_of_sums_allowed`).
use cubecl::prelude::*;
use kiln_kernels::gemm::{gated_gemm, Bf16Weights, Nvfp4Weights, Operand, WeightFormat};
use kiln_kernels::{DeviceArray, KernelError, Precision};
use kiln_reference::data::{normal_with_outliers, Rng};
use kiln_reference::formats::{bf16_encode, bf16_round, pack_u16_words};
use kiln_reference::nvfp4::{quantize_experts, Nvfp4Matrix};
use kiln_reference::tolerance::{compare, swiglu_of_sums_allowed, DType, Tolerance};
use kiln_reference::{activation, gemm};

use crate::report::time_launch;
use crate::{Activation, CaseReport};

/// One GEMM problem. `rows_per_expert = None` is a dense GEMM with `m` rows; otherwise the
/// grouped GEMM with `rows_per_expert[e]` rows for expert `e` (zeros allowed),
/// `m` their sum.
#[derive(Clone, Debug)]
pub struct GemmCase {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub rows_per_expert: Option<Vec<usize>>,
    pub format: WeightFormat,
    /// SwiGLU: a second (up) weight set of the same shape, output `silu(a gate^T) * (a up^T)`
    /// through `gated_gemm`.
    pub gated: bool,
    pub seed: u64,
}

impl GemmCase {
    pub fn dense(m: usize, n: usize, k: usize, seed: u64) -> Self {
        GemmCase {
            m,
            n,
            k,
            rows_per_expert: None,
            format: WeightFormat::Nvfp4,
            gated: false,
            seed,
        }
    }

    pub fn bf16(m: usize, n: usize, k: usize, seed: u64) -> Self {
        GemmCase {
            format: WeightFormat::Bf16,
            ..Self::dense(m, n, k, seed)
        }
    }

    pub fn grouped(rows_per_expert: Vec<usize>, n: usize, k: usize, seed: u64) -> Self {
        let m = rows_per_expert.iter().sum();
        GemmCase {
            rows_per_expert: Some(rows_per_expert),
            ..Self::dense(m, n, k, seed)
        }
    }

    /// The same case as a SwiGLU pair (gate and up).
    pub fn gated(self) -> Self {
        GemmCase {
            gated: true,
            ..self
        }
    }

    fn experts(&self) -> usize {
        self.rows_per_expert.as_ref().map_or(1, Vec::len)
    }

    fn shape(&self) -> String {
        match &self.rows_per_expert {
            None => format!("M={} N={} K={}", self.m, self.n, self.k),
            Some(rows) => {
                format!(
                    "E={} tokens={} N={} K={}",
                    rows.len(),
                    self.m,
                    self.n,
                    self.k
                )
            }
        }
    }
}

/// The weight operand of a case, on the device.
enum Weights {
    Nvfp4(Nvfp4Weights),
    Bf16(Bf16Weights),
}

impl Weights {
    fn operand(&self) -> Operand<'_> {
        match self {
            Weights::Nvfp4(w) => Operand::Nvfp4(w),
            Weights::Bf16(w) => Operand::Bf16(w),
        }
    }
}

/// `experts x n x k` weights drawn from `rng` in `format`: the exact values the kernel sees,
/// and the device operand.
fn case_weights<R: Runtime>(
    client: &ComputeClient<R>,
    rng: &mut Rng,
    case: &GemmCase,
) -> Result<(Vec<f32>, Weights), KernelError> {
    let experts = case.experts();
    let w = normal_with_outliers(rng, experts * case.n * case.k, 0.05);
    Ok(match case.format {
        WeightFormat::Nvfp4 => {
            let quantized = quantize_experts(&w, experts, case.n, case.k).map_err(|_| {
                KernelError::Alignment {
                    what: "K",
                    value: case.k,
                    multiple: 16,
                }
            })?;
            let exact: Vec<f32> = quantized.iter().flat_map(|e| e.dequantize()).collect();
            (exact, Weights::Nvfp4(upload_weights(client, &quantized)))
        }
        WeightFormat::Bf16 => {
            let bits: Vec<u16> = w.iter().map(|&x| bf16_encode(x)).collect();
            let data = DeviceArray::upload(client, &pack_u16_words(&bits));
            let exact = w.iter().map(|&x| bf16_round(x)).collect();
            (
                exact,
                Weights::Bf16(Bf16Weights {
                    data,
                    experts,
                    n: case.n,
                    k: case.k,
                }),
            )
        }
    })
}

/// Uploads reference-quantized experts in the layout the device's kernels read
/// (re-laid out into MMA fragments on CUDA where the shape tiles).
pub fn upload_weights<R: Runtime>(
    client: &ComputeClient<R>,
    experts: &[Nvfp4Matrix],
) -> Nvfp4Weights {
    let (n, k) = (experts[0].rows, experts[0].cols);
    let packed: Vec<u32> = experts.iter().flat_map(|e| e.packed_words()).collect();
    let scale_bytes: Vec<u8> = experts
        .iter()
        .flat_map(|e| e.scales.iter().copied())
        .collect();
    let globals: Vec<f32> = experts.iter().map(|e| e.global_scale).collect();
    Nvfp4Weights::upload(
        client,
        &packed,
        &scale_bytes,
        &globals,
        experts.len(),
        n,
        k,
        Precision::Bf16,
    )
    .expect("quantized experts match their shape")
}

/// Runs the case on the device and against the reference.
pub fn run_gemm<R: Runtime, F: Activation>(
    client: &ComputeClient<R>,
    case: &GemmCase,
    timing: bool,
) -> Result<CaseReport, KernelError> {
    let mut rng = Rng::new(case.seed);
    let a: Vec<F> = normal_with_outliers(&mut rng, case.m * case.k, 1.0)
        .into_iter()
        .map(F::round_from)
        .collect();
    let a_exact: Vec<f32> = a.iter().map(|x| x.exact_f32()).collect();
    let (w_exact, weights) = case_weights(client, &mut rng, case)?;
    let up = if case.gated {
        Some(case_weights(client, &mut rng, case)?)
    } else {
        None
    };
    let a_dev = DeviceArray::upload(client, &a);
    let out = DeviceArray::filled(client, case.m * case.n, f32::NAN);
    let offsets: Option<Vec<usize>> = case.rows_per_expert.as_ref().map(|rows| {
        std::iter::once(0)
            .chain(rows.iter().scan(0, |acc, r| {
                *acc += r;
                Some(*acc)
            }))
            .collect()
    });
    let offsets_dev = offsets.as_ref().map(|o| {
        let words: Vec<u32> = o.iter().map(|&x| x as u32).collect();
        DeviceArray::upload(client, &words)
    });
    let launch = || match &up {
        Some((_, up)) => gated_gemm(
            client,
            &a_dev,
            case.m,
            weights.operand(),
            up.operand(),
            offsets_dev.as_ref(),
            &out,
            Precision::Bf16,
        ),
        None => weights.operand().gemm(
            client,
            &a_dev,
            case.m,
            offsets_dev.as_ref(),
            &out,
            Precision::Bf16,
        ),
    };
    launch()?;
    let product = |w: &[f32]| match &offsets {
        None => (
            gemm::gemm_nt(&a_exact, w, case.m, case.n, case.k),
            gemm::gemm_nt_magnitude(&a_exact, w, case.m, case.n, case.k),
        ),
        Some(o) => (
            gemm::grouped_gemm_nt(&a_exact, w, o, case.n, case.k),
            gemm::grouped_gemm_nt_magnitude(&a_exact, w, o, case.n, case.k),
        ),
    };
    let (sums, magnitude) = product(&w_exact);
    let actual = out.read(client);
    // The tensor-core paths round activations to bf16 and apply the NVFP4 global scale
    // to the sum (one more rounding); see `kiln_kernels::gemm`.
    let grouped = case.rows_per_expert.is_some();
    let path = weights
        .operand()
        .path(client, case.m, grouped, Precision::Bf16);
    let tensor_cores = path.rounds_activations();
    let tol = if tensor_cores {
        Tolerance::dot(case.k + 1, DType::F32, DType::F32).with_operands(DType::BF16)
    } else {
        Tolerance::dot(case.k, DType::F32, DType::F32)
    };
    let (expected, allowed) = match &up {
        None => {
            let allowed = tol.allowed_all(&sums, &magnitude);
            (sums, allowed)
        }
        Some((up_exact, _)) => {
            let (up_sums, up_magnitude) = product(up_exact);
            (0..sums.len())
                .map(|i| {
                    let (g, u) = (sums[i], up_sums[i]);
                    let (g_err, u_err) = (
                        tol.allowed(g, magnitude[i]),
                        tol.allowed(u, up_magnitude[i]),
                    );
                    (
                        activation::silu(g) * u,
                        swiglu_of_sums_allowed(g, u, g_err, u_err),
                    )
                })
                .unzip()
        }
    };
    let cmp = compare(&actual, &expected, &allowed);
    let kernel = match (case.format, case.rows_per_expert.is_some(), case.gated) {
        (_, false, true) => "gated_gemm",
        (_, true, true) => "gated_grouped_gemm",
        (WeightFormat::Bf16, false, _) => "bf16_gemm",
        (WeightFormat::Bf16, true, _) => "bf16_grouped_gemm",
        (WeightFormat::Nvfp4, false, _) => "nvfp4_gemm",
        (WeightFormat::Nvfp4, true, _) => "nvfp4_grouped_gemm",
    };
    let mut report = CaseReport::from_comparison(
        kernel,
        case.shape(),
        F::NAME,
        if tensor_cores {
            format!("gamma_{}(f32) + bf16 operands ({path:?})", case.k + 1)
        } else {
            format!("gamma_{}(f32)", case.k)
        },
        &cmp,
    );
    report.time_us = time_launch(client, timing, || launch().expect("validated above"));
    Ok(report)
}
