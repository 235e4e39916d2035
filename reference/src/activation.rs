//! SwiGLU activation of a fused gate/up projection: `silu(gate) * up`, in f64.
//!
//! Each row of the input is `[gate (inter) | up (inter)]`, the layout of a fused
//! `gate_up_proj` output (HF transformers' DeepseekV3 experts); the output row has
//! `inter` values. `silu(g) = g * sigmoid(g) = g / (1 + exp(-g))`, which is finite for
//! every finite g (exp(-g) may overflow to inf, giving -0, the correct limit).

/// `silu(x) = x / (1 + exp(-x))`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// `silu(gate) * up` for each row `[gate | up]` of `x` (`[rows, 2 * inter]`).
///
/// Panics if `inter` is zero or `x.len()` is not a multiple of `2 * inter`.
pub fn silu_and_mul(x: &[f32], inter: usize) -> Vec<f64> {
    assert!(inter > 0, "inter is zero");
    assert_eq!(
        x.len() % (2 * inter),
        0,
        "x has {} elements, not rows of 2*{inter}",
        x.len()
    );
    x.chunks(2 * inter)
        .flat_map(|row| {
            let (gate, up) = row.split_at(inter);
            gate.iter()
                .zip(up)
                .map(|(&g, &u)| silu(g as f64) * u as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_known_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_578_630_004_9).abs() < 1e-15);
        assert_eq!(silu(-1000.0), -0.0);
        assert_eq!(silu(1000.0), 1000.0);
    }

    #[test]
    fn gate_and_up_halves_are_paired() {
        let y = silu_and_mul(&[0.0, 1000.0, 5.0, 2.0, 1000.0, 0.0, 3.0, 3.0], 2);
        assert_eq!(y, vec![0.0, 2000.0, 3000.0, 0.0]);
    }
}
