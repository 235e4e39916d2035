//! The project's one tolerance helper: rounding-error bounds derived per dtype, and
//! the comparison of a kernel's output against the f64 oracle.
//!
//! Every bound is a worst-case rounding-error bound, not a fudge factor, so a failure
//! means a real bug (or a kernel that rounds more often than its declared dtypes say).
//! With unit roundoff `u` (half the distance from 1 to the next value):
//!
//! - **Dot products** (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
//!   ed., Thm 3.1 and Lemma 3.3, and §3.1 on pairwise/tree summation): a sum of `n`
//!   products of exactly-represented factors, computed in precision `u` in *any*
//!   order (serial, blocked, tree, split-K with a final reduction, FMA or not) has
//!   `|computed - exact| <= gamma_n * sum_i |a_i b_i|` with `gamma_n = n u / (1 - n u)`.
//!   Each term passes through at most `n` roundings (one per product, at most `n - 1`
//!   additions on its way to the root of any summation tree), each a factor
//!   `(1 + delta)`, `|delta| <= u`; Lemma 3.1 bounds a product of `n` such factors by
//!   `1 + theta_n`, `|theta_n| <= gamma_n`. An FMA only removes roundings.
//! - **Output rounding**: storing the result in the output dtype adds at most
//!   `u_out * |value|` for normal values, and at most half the subnormal spacing below
//!   the smallest normal; the smallest normal is used as a (generous) absolute floor.
//!
//! Quantized *inputs* (bf16, e4m3, NVFP4 weights) are not covered by these bounds:
//! the oracle must be fed the same quantized values the kernel reads (see
//! `nvfp4::Nvfp4Matrix::dequantize`, `mla::PagedKv::fp8_round`).

use std::fmt;

/// Floating-point formats a kernel may accumulate in or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F64,
    F32,
    F16,
    BF16,
    /// FP8 E4M3FN.
    E4M3,
    /// FP4 E2M1.
    E2M1,
}

impl DType {
    /// Unit roundoff `u = 2^-(p)` for `p` significand bits (implicit bit included):
    /// f64 2^-53, f32 2^-24, f16 2^-11, bf16 2^-8, e4m3 2^-4, e2m1 2^-2.
    pub fn unit_roundoff(self) -> f64 {
        let bits = match self {
            Self::F64 => 53,
            Self::F32 => 24,
            Self::F16 => 11,
            Self::BF16 => 8,
            Self::E4M3 => 4,
            Self::E2M1 => 2,
        };
        2f64.powi(-bits)
    }

    /// Smallest positive normal value.
    pub fn smallest_normal(self) -> f64 {
        let exp = match self {
            Self::F64 => -1022,
            Self::F32 | Self::BF16 => -126,
            Self::F16 => -14,
            Self::E4M3 => -6,
            Self::E2M1 => 0,
        };
        2f64.powi(exp)
    }
}

/// `gamma_n = n u / (1 - n u)` for `dtype`'s unit roundoff; infinite once `n u >= 1`
/// (no bound exists: a sum that long in that precision can be anything).
pub fn gamma(n: usize, dtype: DType) -> f64 {
    let nu = n as f64 * dtype.unit_roundoff();
    if nu >= 1.0 {
        f64::INFINITY
    } else {
        nu / (1.0 - nu)
    }
}

/// Error bound of a dot-product-shaped result (GEMM, grouped GEMM, norms, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tolerance {
    /// Number of products summed per output (K of a GEMM; add the epilogue's extra
    /// roundings, e.g. +1 for a scale multiply).
    pub terms: usize,
    /// Accumulation precision.
    pub acc: DType,
    /// Output storage precision.
    pub out: DType,
    /// The type one operand of every product is rounded to before it is multiplied (None
    /// when the kernel multiplies them as given; bf16 on tensor cores fed f32 activations).
    pub operands: Option<DType>,
}

impl Tolerance {
    /// A sum of `terms` products accumulated in `acc`, stored as `out`.
    pub fn dot(terms: usize, acc: DType, out: DType) -> Self {
        Self {
            terms,
            acc,
            out,
            operands: None,
        }
    }

    /// The same sum with one operand of every product rounded to `operands` first: each
    /// product moves by at most `u_op` of its magnitude, the sum by `u_op * magnitude`.
    pub fn with_operands(self, operands: DType) -> Self {
        Self {
            operands: Some(operands),
            ..self
        }
    }

    /// Allowed `|actual - expected|` for one output whose exact value is `expected`
    /// and whose `sum |a_i b_i|` is `magnitude`:
    /// `(gamma(terms, acc) + u_op) * magnitude + u_out * (|expected| + that) +
    /// smallest_normal(out)`, with `u_op` the operand rounding ([`Self::with_operands`]).
    /// (The output rounding applies to the computed value, hence the second-order
    /// `u_out * gamma * magnitude` term.)
    pub fn allowed(&self, expected: f64, magnitude: f64) -> f64 {
        let u_op = self.operands.map_or(0.0, DType::unit_roundoff);
        let acc_err = (gamma(self.terms, self.acc) + u_op) * magnitude;
        acc_err + self.out.unit_roundoff() * (expected.abs() + acc_err) + self.out.smallest_normal()
    }

    /// [`Self::allowed`] for every element.
    pub fn allowed_all(&self, expected: &[f64], magnitude: &[f64]) -> Vec<f64> {
        assert_eq!(
            expected.len(),
            magnitude.len(),
            "expected and magnitude lengths differ"
        );
        expected
            .iter()
            .zip(magnitude)
            .map(|(&e, &m)| self.allowed(e, m))
            .collect()
    }
}

/// Allowed error of one attention output element (softmax(scale * q k^T) v).
///
/// Derivation, with `V = value_magnitude`, `u = u_acc` and `u_op` the unit roundoff of the
/// operands the kernel multiplies (f32 on CUDA cores, bf16 on tensor cores):
/// 0. Operands: rounding the queries (and, where the cache stores scaled codes, the
///    dequantised keys) to the operand type moves each product `q_d k_d` by at most
///    `2 u_op |q_d k_d|`, so each score by `2 u_op * score_magnitude`, counted into `eps_s`
///    below; rounding the softmax weights (and dequantised values) moves each weighted term
///    by `2 u_op` relative, the output by at most `2 u_op V`.
/// 1. Scores: each is a `head_dim`-term dot product times the softmax scale (and
///    possibly times log2(e) when a kernel uses exp2): `head_dim + 2` roundings, so
///    `|ds_j| <= eps_s = (gamma(head_dim + 2) + 2 u_op) * score_magnitude`.
/// 2. Perturbing every score by at most `eps_s` multiplies each softmax weight
///    `w_j = e^{s_j} / sum_k e^{s_k}` by a factor in `[e^{-2 eps_s}, e^{2 eps_s}]`
///    (numerator and denominator move at most `e^{eps_s}` each way), so the output
///    moves by at most `(e^{2 eps_s} - 1) * sum_j w_j |v_j| <= (e^{2 eps_s} - 1) V`.
/// 3. `exp` itself: WGSL allows `3 + 2|x|` ulp for `exp(x)`; after max subtraction
///    `x <= 0`, and weights with `x < -30` are below `e^-30 ~ 1e-13` of the largest,
///    so the clamped argument gives at most ~63 ulp: `64 u` relative per weight, in
///    numerator and denominator alike, covers it together with the division.
///    Flash-style online softmax rescales the accumulator by `exp(m_old - m_new)`
///    once per KV block; with blocks of >= 32 rows that is at most `kv_len / 32`
///    rescalings of <= 64 u each, i.e. <= `2 kv_len * u`, inside the next term.
/// 4. Sums: the numerator `sum_j e_j v_j` and the denominator `sum_j e_j` are each
///    sums of `kv_len` terms (any order, split-KV combine included): `gamma(kv_len)`
///    each, relative to `sum_j w_j |v_j| <= V`; plus the final division: `gamma(4
///    kv_len + 2) * V` covers both sums, the division and the rescalings of step 3.
/// 5. Output rounding: `u_out * V` (|out| <= V since the weights sum to 1).
///
/// Result: `(e^{2 eps_s} - 1 + 64 u + 2 u_op + gamma(4 kv_len + 2)) * V + u_out * V`.
pub fn attention_allowed(
    head_dim: usize,
    kv_len: usize,
    score_magnitude: f64,
    value_magnitude: f64,
    operands: DType,
    acc: DType,
    out: DType,
) -> f64 {
    let u_op = operands.unit_roundoff();
    let eps_s = (gamma(head_dim + 2, acc) + 2.0 * u_op) * score_magnitude;
    let u = acc.unit_roundoff();
    let relative = (2.0 * eps_s).exp_m1() + 64.0 * u + 2.0 * u_op + gamma(4 * kv_len + 2, acc);
    (relative + out.unit_roundoff()) * value_magnitude
}

/// Allowed error of one rotated RoPE element at position `pos`, whose pair has
/// `|x0| + |x1| = pair_magnitude`, with the cos/sin scale `scale`.
///
/// Derivation, with `u = u_acc`:
/// 1. The angle `pos * inv_freq` is formed in f32 as the peers do: the frequency is
///    rounded once and the product once, so the angle is off by at most
///    `2 u |angle| <= 2 u pos` (inv_freq <= 1).
/// 2. `sin` and `cos` themselves: WGSL only promises an absolute error of 2^-11 on
///    [-pi, pi] (CUDA's non-fast sinf/cosf: 2 ulp), and range reduction of larger angles
///    adds the angle's own rounding, already counted in 1. So each of cos and sin is off
///    by at most `2^-11 + 2 u pos`.
/// 3. `x0 cos - x1 sin` then moves by at most `pair_magnitude` times that, and the two
///    products, the difference and the scale multiply add `4 u` relative to
///    `pair_magnitude * scale`.
///
/// Result: `(2^-11 + 2 u pos + 4 u) * pair_magnitude * scale + u_out |expected|`.
pub fn rope_allowed(
    pos: usize,
    pair_magnitude: f64,
    scale: f64,
    expected: f64,
    acc: DType,
    out: DType,
) -> f64 {
    let u = acc.unit_roundoff();
    let trig = 2f64.powi(-11) + 2.0 * u * pos as f64;
    (trig + 4.0 * u) * pair_magnitude * scale + out.unit_roundoff() * expected.abs()
}

/// Allowed `|actual - expected|` for one SwiGLU output `silu(gate) * up` computed in f32
/// (`expected` exact):
/// 1. `exp(-gate)` is allowed `3 + 2|gate|` ulp (WGSL's bound; CUDA's is tighter), the
///    reciprocal of `1 + exp` 2.5 ulp, the two products 1 ulp each: with an ulp at most
///    `2u` relative, `(7.5 + 2|gate|) * 2u * |expected|`.
/// 2. Far in the negative tail, where `sigmoid(gate) < 2^-100` (`gate < -69.3`), backends
///    may return 0 for the sigmoid (llvmpipe does): the whole value, below
///    `|gate| 2^-100 |up|`, is allowed there.
/// 3. Plus the smallest normal f32, for results in the subnormal range.
pub fn swiglu_allowed(gate: f64, expected: f64) -> f64 {
    let u = DType::F32.unit_roundoff();
    let flushed = if gate < -100.0 * std::f64::consts::LN_2 {
        expected.abs()
    } else {
        0.0
    };
    (7.5 + 2.0 * gate.abs()) * 2.0 * u * expected.abs() + flushed + DType::F32.smallest_normal()
}

/// Allowed `|actual - expected|` for `silu(gate) * up` computed in f32 from sums `gate` and
/// `up` that are themselves off by up to `gate_err` and `up_err` (two GEMM outputs fed to the
/// activation, fused or not): `silu` moves by at most `1.1` (the bound of its slope) times
/// `gate_err`, so the product by `1.1 gate_err (|up| + up_err) + |silu(gate)| up_err`, plus
/// [`swiglu_allowed`] at whichever end of the gate's interval allows more.
pub fn swiglu_of_sums_allowed(gate: f64, up: f64, gate_err: f64, up_err: f64) -> f64 {
    let silu = crate::activation::silu(gate);
    let propagated = 1.1 * gate_err * (up.abs() + up_err) + silu.abs() * up_err;
    let largest = (silu * up).abs() + propagated;
    propagated
        + swiglu_allowed(gate - gate_err, largest).max(swiglu_allowed(gate + gate_err, largest))
}

/// Summary of an element-wise comparison against the oracle.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// Number of elements compared.
    pub len: usize,
    /// Largest `|actual - expected|` over finite elements.
    pub max_abs_err: f64,
    /// Largest `|actual - expected| / |expected|` over finite elements with
    /// `expected != 0`.
    pub max_rel_err: f64,
    /// Element with the largest `err / allowed` (non-finite elements count as
    /// infinite); the first one on ties.
    pub worst_index: usize,
    /// `err / allowed` at `worst_index` (0 when both are 0, infinite when only the
    /// allowance is 0 or the element is non-finite).
    pub worst_ratio: f64,
    /// Elements with `err > allowed`.
    pub failures: usize,
    /// Elements where `actual` or `expected` is NaN or infinite (always a failure).
    pub non_finite: usize,
    /// `actual[worst_index]`.
    pub worst_actual: f32,
    /// `expected[worst_index]`.
    pub worst_expected: f64,
    /// `allowed[worst_index]`.
    pub worst_allowed: f64,
}

impl Comparison {
    /// True iff something was compared and every element was finite and within bounds.
    pub fn passed(&self) -> bool {
        self.failures == 0 && self.non_finite == 0 && self.len > 0
    }
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of {} elements out of bounds, {} non-finite; worst at index {}: actual {:e}, \
             expected {:e}, allowed {:e} (ratio {:.3}); max abs err {:e}, max rel err {:e}",
            self.failures,
            self.len,
            self.non_finite,
            self.worst_index,
            self.worst_actual,
            self.worst_expected,
            self.worst_allowed,
            self.worst_ratio,
            self.max_abs_err,
            self.max_rel_err
        )
    }
}

/// Compares `actual` with `expected` element-wise against per-element `allowed`
/// absolute errors.
///
/// Panics if the three slices differ in length.
pub fn compare(actual: &[f32], expected: &[f64], allowed: &[f64]) -> Comparison {
    assert!(
        actual.len() == expected.len() && expected.len() == allowed.len(),
        "compare: lengths differ (actual {}, expected {}, allowed {})",
        actual.len(),
        expected.len(),
        allowed.len()
    );
    let mut c = Comparison {
        len: actual.len(),
        max_abs_err: 0.0,
        max_rel_err: 0.0,
        worst_index: 0,
        worst_ratio: 0.0,
        failures: 0,
        non_finite: 0,
        worst_actual: actual.first().copied().unwrap_or(0.0),
        worst_expected: expected.first().copied().unwrap_or(0.0),
        worst_allowed: allowed.first().copied().unwrap_or(0.0),
    };
    for (i, ((&a, &e), &t)) in actual.iter().zip(expected).zip(allowed).enumerate() {
        let ratio = if !a.is_finite() || !e.is_finite() {
            c.non_finite += 1;
            f64::INFINITY
        } else {
            let err = (a as f64 - e).abs();
            c.max_abs_err = c.max_abs_err.max(err);
            if e != 0.0 {
                c.max_rel_err = c.max_rel_err.max(err / e.abs());
            }
            if err > t {
                c.failures += 1;
            }
            match (err, t) {
                (0.0, _) => 0.0,
                (_, t) if t > 0.0 => err / t,
                _ => f64::INFINITY,
            }
        };
        if ratio > c.worst_ratio {
            c.worst_ratio = ratio;
            c.worst_index = i;
            c.worst_actual = a;
            c.worst_expected = e;
            c.worst_allowed = t;
        }
    }
    c
}

#[cfg(test)]
#[path = "tolerance_tests.rs"]
mod tests;
