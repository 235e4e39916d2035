//! NVFP4 weight quantization: E2M1 values, one E4M3 scale per 16 elements along K,
//! one f32 per-tensor scale.
//!
//! A weight `w[r, c]` of an `[rows, cols]` matrix (`cols` = K, contiguous) is stored as
//! `e2m1(code[r, c]) * e4m3(scale[r, c / 16]) * global_scale`. Invariants:
//! - `cols % 16 == 0`; `packed` holds `rows * cols / 2` bytes, the low nibble is the
//!   even element, the high nibble the odd one; `scales` holds `rows * cols / 16` E4M3
//!   codes, row-major;
//! - `global_scale = amax / (6 * 448)` (ModelOpt's `weight_scale_2`), 1.0 when the
//!   matrix is all zeros, so a block holding the tensor's amax gets scale code 448;
//! - block scales are clamped to `[2^-9, 448]` before E4M3 rounding, so they are never
//!   zero and never NaN;
//! - `value()` multiplies in f32, left to right, `e2m1 * scale * global_scale`: GPU
//!   kernels are expected to match it bit for bit.
//!
//! Follows NVIDIA ModelOpt's NVFP4 checkpoint format (see `shared/ANCHORS.md`).

use crate::formats::{
    e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, pack_u8_words, FormatError, E2M1_MAX,
    E4M3_MAX,
};

/// Elements per E4M3 block scale, along K.
pub const BLOCK: usize = 16;

/// Smallest block scale the quantizer emits (the smallest E4M3 subnormal).
const MIN_BLOCK_SCALE: f32 = 1.0 / 512.0;

/// An NVFP4-quantized `[rows, cols]` matrix, K (`cols`) contiguous.
#[derive(Debug, Clone, PartialEq)]
pub struct Nvfp4Matrix {
    /// Number of rows (N, output features).
    pub rows: usize,
    /// Number of columns (K, input features); a multiple of [`BLOCK`].
    pub cols: usize,
    /// E2M1 codes, two per byte: low nibble = element `2i`, high nibble = `2i + 1`.
    pub packed: Vec<u8>,
    /// E4M3 block-scale codes, `[rows, cols / 16]`.
    pub scales: Vec<u8>,
    /// Per-tensor f32 scale, `amax / (6 * 448)`.
    pub global_scale: f32,
}

/// Checks the shape and values of a matrix about to be quantized.
fn check_input(w: &[f32], rows: usize, cols: usize) -> Result<(), FormatError> {
    if !cols.is_multiple_of(BLOCK) {
        return Err(FormatError::ColsNotMultipleOfBlock { cols, block: BLOCK });
    }
    if w.len() != rows * cols {
        return Err(FormatError::LengthMismatch {
            expected: rows * cols,
            got: w.len(),
        });
    }
    match w.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(FormatError::NonFinite { index }),
        None => Ok(()),
    }
}

/// ModelOpt's per-tensor scale: `amax / (6 * 448)`, 1.0 for an all-zero tensor (or one
/// so tiny that the division underflows to zero; its elements then all encode as 0).
fn global_scale_for(w: &[f32]) -> f32 {
    let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = amax / (E2M1_MAX * E4M3_MAX);
    if scale == 0.0 {
        1.0
    } else {
        scale
    }
}

impl Nvfp4Matrix {
    /// Quantizes a row-major `[rows, cols]` f32 matrix.
    ///
    /// Block scale: `e4m3_encode(clamp(block_amax / 6 / global_scale, 2^-9, 448))`;
    /// element: `e2m1_encode(x / (e4m3_decode(scale) * global_scale))`, all in f32.
    pub fn quantize(w: &[f32], rows: usize, cols: usize) -> Result<Self, FormatError> {
        check_input(w, rows, cols)?;
        let global_scale = global_scale_for(w);
        let mut scales = Vec::with_capacity(rows * cols / BLOCK);
        let mut codes = Vec::with_capacity(rows * cols);
        for block in w.chunks(BLOCK) {
            let block_amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let target = (block_amax / E2M1_MAX / global_scale).clamp(MIN_BLOCK_SCALE, E4M3_MAX);
            let scale_code = e4m3_encode(target);
            let divisor = e4m3_decode(scale_code) * global_scale;
            scales.push(scale_code);
            codes.extend(block.iter().map(|&x| e2m1_encode(x / divisor)));
        }
        let packed = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
        Ok(Self {
            rows,
            cols,
            packed,
            scales,
            global_scale,
        })
    }

    /// The 4-bit E2M1 code of element `(r, c)`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        assert!(r < self.rows && c < self.cols, "({r}, {c}) out of range");
        let i = r * self.cols + c;
        (self.packed[i / 2] >> (4 * (i % 2))) & 0xf
    }

    /// The E4M3 block-scale code covering element `(r, c)`.
    pub fn scale_code(&self, r: usize, c: usize) -> u8 {
        self.scales[(r * self.cols + c) / BLOCK]
    }

    /// Dequantized element: `e2m1_decode(code) * e4m3_decode(scale) * global_scale`,
    /// evaluated left to right in f32 (the order GPU kernels reproduce).
    pub fn value(&self, r: usize, c: usize) -> f32 {
        e2m1_decode(self.code(r, c)) * e4m3_decode(self.scale_code(r, c)) * self.global_scale
    }

    /// All elements, dequantized with [`Self::value`], row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|r| (0..self.cols).map(move |c| (r, c)))
            .map(|(r, c)| self.value(r, c))
            .collect()
    }

    /// `packed` viewed as little-endian u32 words: nibble `j` of word `w` (bits
    /// `4j..4j+4`) is element `8w + j`.
    pub fn packed_words(&self) -> Vec<u32> {
        pack_u8_words(&self.packed)
    }

    /// Scale codes packed four per u32, little-endian.
    pub fn scale_words(&self) -> Vec<u32> {
        pack_u8_words(&self.scales)
    }
}

/// Quantizes `experts` stacked `[rows, cols]` matrices (`w` is `[experts, rows, cols]`),
/// each with its own global scale.
pub fn quantize_experts(
    w: &[f32],
    experts: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<Nvfp4Matrix>, FormatError> {
    let per_expert = rows * cols;
    if w.len() != experts * per_expert {
        return Err(FormatError::LengthMismatch {
            expected: experts * per_expert,
            got: w.len(),
        });
    }
    (0..experts)
        .map(|e| {
            let slice = &w[e * per_expert..(e + 1) * per_expert];
            Nvfp4Matrix::quantize(slice, rows, cols).map_err(|err| match err {
                FormatError::NonFinite { index } => FormatError::NonFinite {
                    index: index + e * per_expert,
                },
                other => other,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_shapes_and_values() {
        assert_eq!(
            Nvfp4Matrix::quantize(&[0.0; 24], 2, 12),
            Err(FormatError::ColsNotMultipleOfBlock {
                cols: 12,
                block: 16
            })
        );
        assert_eq!(
            Nvfp4Matrix::quantize(&[0.0; 31], 2, 16),
            Err(FormatError::LengthMismatch {
                expected: 32,
                got: 31
            })
        );
        let mut w = vec![1.0; 32];
        w[17] = f32::NAN;
        assert_eq!(
            Nvfp4Matrix::quantize(&w, 2, 16),
            Err(FormatError::NonFinite { index: 17 })
        );
        assert_eq!(
            quantize_experts(&w, 2, 1, 16),
            Err(FormatError::NonFinite { index: 17 })
        );
    }

    #[test]
    fn all_zero_matrix_has_unit_global_scale_and_zero_codes() {
        let q = Nvfp4Matrix::quantize(&[0.0; 32], 1, 32).unwrap();
        assert_eq!(q.global_scale, 1.0);
        assert!(q.packed.iter().all(|&b| b == 0));
        assert!(q.dequantize().iter().all(|&v| v == 0.0));
    }

    #[test]
    fn nibble_order_is_low_then_high() {
        let mut w = vec![0.0f32; 16];
        w[0] = 6.0; // code 7
        w[1] = -1.0; // code 0xA
        let q = Nvfp4Matrix::quantize(&w, 1, 16).unwrap();
        assert_eq!(q.packed[0], 0xA7);
        assert_eq!(q.code(0, 0), 0x7);
        assert_eq!(q.code(0, 1), 0xA);
        assert_eq!(q.packed_words()[0] & 0xff, 0xA7);
    }

    #[test]
    fn experts_get_their_own_global_scale() {
        let mut w = vec![1.0f32; 64];
        for v in &mut w[32..] {
            *v = 100.0;
        }
        let qs = quantize_experts(&w, 2, 2, 16).unwrap();
        assert_eq!(qs[0].global_scale, 1.0 / 2688.0);
        assert_eq!(qs[1].global_scale, 100.0 / 2688.0);
        assert_eq!(qs[1].dequantize(), vec![qs[1].value(0, 0); 32]);
    }
}
