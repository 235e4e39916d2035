//! Dense and grouped (MoE) matrix products in the "NT" layout, accumulated in f64.
//!
//! `C[m, n] = sum_k A[m, k] * W[n, k]`: both operands are K-contiguous, as a linear
//! layer's weight `[out, in]` is stored. Each product of two f32 values is exact in
//! f64 and the sum of at most a few thousand of them loses ~1e-16 relative to the
//! magnitude, so these results serve as the exact value for kernel tolerances. The
//! `*_magnitude` twins return `sum_k |A[m, k]| |W[n, k]|`, the quantity the error bound
//! of any summation order is proportional to (see `tolerance`).
//!
//! Grouped form follows the MoE convention of sorting token rows by expert: rows
//! `offsets[e]..offsets[e + 1]` of A multiply expert `e`'s weight.

/// Checks the operand sizes of an NT product; panics with the mismatch.
fn check_nt<A>(a: &[A], w: &[f32], m: usize, n: usize, k: usize) {
    assert_eq!(
        a.len(),
        m * k,
        "A has {} elements, expected m*k = {m}*{k}",
        a.len()
    );
    assert_eq!(
        w.len(),
        n * k,
        "W has {} elements, expected n*k = {n}*{k}",
        w.len()
    );
}

/// `C[m, n] = sum_k a[m, k] * w[n, k]` in f64, with `a: [m, k]`, `w: [n, k]`.
///
/// Panics if the slice lengths do not match the shape.
pub fn gemm_nt(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    nt_map(a, w, m, n, k, |x, y| x * y)
}

/// [`gemm_nt`] with f64 activations: `C[m, n] = sum_k a[m, k] * w[n, k]`, `a: [m, k]`
/// in f64 (e.g. a model's hidden states, kept in f64 between layers), `w: [n, k]`.
///
/// Panics if the slice lengths do not match the shape.
pub fn gemm_nt_f64(a: &[f64], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    nt_map(a, w, m, n, k, |x, y| x * y)
}

/// `sum_k |a[m, k]| * |w[n, k]|` in f64, the scale of `gemm_nt`'s rounding error.
pub fn gemm_nt_magnitude(a: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    nt_map(a, w, m, n, k, |x, y| (x * y).abs())
}

/// Shared loop: `C[i, j] = sum_k term(a[i, k], w[j, k])` in f64.
fn nt_map<A: Copy + Into<f64>>(
    a: &[A],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    term: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    check_nt(a, w, m, n, k);
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        let row = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let col = &w[j * k..(j + 1) * k];
            c[i * n + j] = row
                .iter()
                .zip(col)
                .map(|(&x, &y)| term(x.into(), y as f64))
                .sum();
        }
    }
    c
}

/// Grouped NT product: `a` is `[offsets[E], k]` with rows sorted by expert, `w` is
/// `[E, n, k]`; rows `offsets[e]..offsets[e + 1]` use `w[e * n * k..]`. Returns
/// `[offsets[E], n]` in f64. `offsets` has `E + 1` non-decreasing entries, starting
/// at 0 (empty experts allowed).
///
/// Panics if the offsets or slice lengths are inconsistent.
pub fn grouped_gemm_nt(a: &[f32], w: &[f32], offsets: &[usize], n: usize, k: usize) -> Vec<f64> {
    grouped(a, w, offsets, n, k, gemm_nt)
}

/// Grouped twin of [`gemm_nt_magnitude`].
pub fn grouped_gemm_nt_magnitude(
    a: &[f32],
    w: &[f32],
    offsets: &[usize],
    n: usize,
    k: usize,
) -> Vec<f64> {
    grouped(a, w, offsets, n, k, gemm_nt_magnitude)
}

type NtFn = fn(&[f32], &[f32], usize, usize, usize) -> Vec<f64>;

fn grouped(a: &[f32], w: &[f32], offsets: &[usize], n: usize, k: usize, f: NtFn) -> Vec<f64> {
    assert!(!offsets.is_empty(), "offsets needs E + 1 entries");
    assert_eq!(offsets[0], 0, "offsets must start at 0");
    assert!(
        offsets.windows(2).all(|p| p[0] <= p[1]),
        "offsets must not decrease: {offsets:?}"
    );
    let experts = offsets.len() - 1;
    let rows = offsets[experts];
    assert_eq!(
        a.len(),
        rows * k,
        "A has {} elements, expected {rows}*{k}",
        a.len()
    );
    assert_eq!(
        w.len(),
        experts * n * k,
        "W has {} elements, expected {experts}*{n}*{k}",
        w.len()
    );
    let mut c = Vec::with_capacity(rows * n);
    for e in 0..experts {
        let (lo, hi) = (offsets[e], offsets[e + 1]);
        let we = &w[e * n * k..(e + 1) * n * k];
        c.extend(f(&a[lo * k..hi * k], we, hi - lo, n, k));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_product_is_exact() {
        // A = [[1, 2], [3, 4], [5, 6]], W = [[1, -1], [2, 0.5]]
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = [1.0, -1.0, 2.0, 0.5];
        assert_eq!(
            gemm_nt(&a, &w, 3, 2, 2),
            vec![-1.0, 3.0, -1.0, 8.0, -1.0, 13.0]
        );
        assert_eq!(
            gemm_nt_magnitude(&a, &w, 3, 2, 2),
            vec![3.0, 3.0, 7.0, 8.0, 11.0, 13.0]
        );
    }

    #[test]
    fn grouped_product_uses_each_experts_weight() {
        let a = [1.0, 2.0, 3.0]; // k = 1, rows 0 -> expert 0, rows 1..3 -> expert 2
        let w = [10.0, -1.0, 7.0]; // n = 1: expert 0 = 10, expert 1 = -1, expert 2 = 7
        assert_eq!(
            grouped_gemm_nt(&a, &w, &[0, 1, 1, 3], 1, 1),
            vec![10.0, 14.0, 21.0]
        );
        assert_eq!(
            grouped_gemm_nt_magnitude(&[-1.0], &[-2.0], &[0, 1], 1, 1),
            vec![2.0]
        );
    }

    #[test]
    #[should_panic(expected = "must not decrease")]
    fn decreasing_offsets_panic() {
        grouped_gemm_nt(&[], &[0.0; 2], &[0, 1, 0], 1, 1);
    }
}
