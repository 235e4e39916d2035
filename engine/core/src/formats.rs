//! Scalar number formats: E2M1 (FP4), E4M3FN (FP8), BF16, and word packing.
//!
//! Computes the encode/decode maps that every quantized kernel must reproduce bit for
//! bit. Invariants:
//! - every encoder rounds to nearest, ties to the even code (the code whose lowest
//!   mantissa bit is 0), as the OCP Microscaling spec and NVIDIA's `cvt.rn.satfinite`
//!   instructions do;
//! - the FP4/FP8 encoders saturate: any finite or infinite magnitude above the largest
//!   value encodes as the largest value with the input's sign;
//! - the sign of the input is kept, so small negative values encode as negative zero;
//! - `decode(encode(decode(c))) == decode(c)` for every non-NaN code.
//!
//! Follows the OCP 8-bit floating point spec (E4M3FN: bias 7, no infinities, only
//! `S.1111.111` is NaN, max 448) and the OCP MX spec for E2M1 (bias 1, no inf/NaN,
//! max 6). The FP4/FP8 encoders share one minifloat rounding routine: pick the binade,
//! divide by the quantum (exact: a power of two), round the quotient ties-to-even.

use std::fmt;

/// Errors raised when building quantized tensors from unsuitable input.
#[derive(Debug, Clone, PartialEq)]
pub enum FormatError {
    /// The contiguous (K) axis is not a whole number of scale blocks.
    ColsNotMultipleOfBlock { cols: usize, block: usize },
    /// A buffer does not hold the number of elements its shape says.
    LengthMismatch { expected: usize, got: usize },
    /// An input value is NaN or infinite; quantizers only accept finite values.
    NonFinite { index: usize },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ColsNotMultipleOfBlock { cols, block } => {
                write!(f, "cols {cols} is not a multiple of the block size {block}")
            }
            Self::LengthMismatch { expected, got } => {
                write!(f, "expected {expected} elements, got {got}")
            }
            Self::NonFinite { index } => write!(f, "value at index {index} is not finite"),
        }
    }
}

impl std::error::Error for FormatError {}

/// Magnitudes of the eight non-negative E2M1 codes.
const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Largest finite E4M3FN magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// `2^e` as an f32, for `-126 <= e <= 127` (built from the bit pattern, so exact).
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// A binary minifloat without infinities, described by its mantissa width, the
/// exponent of its smallest normal binade, its largest magnitude code and value.
struct Minifloat {
    mantissa_bits: u32,
    min_exp: i32,
    max_code: u8,
    max_value: f32,
}

impl Minifloat {
    /// Magnitude code of `|x|` (finite, not NaN), rounded to nearest, ties to even,
    /// saturating at `max_code`.
    fn encode_magnitude(&self, mag: f32) -> u8 {
        if mag >= self.max_value {
            return self.max_code;
        }
        // floor(log2(mag)) for normal f32; f32 subnormals and zero land far below
        // `min_exp` and are clamped into the minifloat's subnormal binade.
        let exp = (((mag.to_bits() >> 23) & 0xff) as i32 - 127).max(self.min_exp);
        let quantum = pow2(exp - self.mantissa_bits as i32);
        // Exact division by a power of two; the quotient is in [0, 2^(m+1)].
        let steps = (mag / quantum).round_ties_even() as u32;
        // `steps` counts quanta from zero. In the subnormal binade that is the whole
        // code; in binade `b` above it, it includes the implicit leading one (2^m
        // quanta), so the code is (b << m) + steps. A carry (steps == 2^(m+1)) lands
        // on the first code of the next binade, as it should.
        let code = (((exp - self.min_exp) as u32) << self.mantissa_bits) + steps;
        code.min(self.max_code as u32) as u8
    }
}

const E2M1: Minifloat = Minifloat {
    mantissa_bits: 1,
    min_exp: 0,
    max_code: 0x7,
    max_value: E2M1_MAX,
};

const E4M3: Minifloat = Minifloat {
    mantissa_bits: 3,
    min_exp: -6,
    max_code: 0x7e,
    max_value: E4M3_MAX,
};

/// Encodes `x` as a 4-bit E2M1 code (bit 3 = sign, bits 0..3 = magnitude code).
///
/// Rounds to nearest, ties to the even code; saturates to ±6 (infinities included).
/// E2M1 has no NaN: NaN encodes as `0x7` (+6), the same choice as saturating
/// hardware conversions, so a NaN shows up as a large, visible value.
pub fn e2m1_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign = if x.is_sign_negative() { 0x8 } else { 0 };
    sign | E2M1.encode_magnitude(x.abs())
}

/// Decodes the low 4 bits of `code` as E2M1 (higher bits are ignored).
pub fn e2m1_decode(code: u8) -> f32 {
    let mag = E2M1_VALUES[(code & 0x7) as usize];
    if code & 0x8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Encodes `x` as FP8 E4M3FN (bias 7, subnormals, max 448, no infinities).
///
/// Rounds to nearest, ties to even; saturates to ±448 (infinities included);
/// NaN encodes as `0x7F`.
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    sign | E4M3.encode_magnitude(x.abs())
}

/// Decodes an FP8 E4M3FN code; `0x7F` and `0xFF` decode as NaN.
pub fn e4m3_decode(code: u8) -> f32 {
    let mag_code = code & 0x7f;
    if mag_code == 0x7f {
        return f32::NAN;
    }
    let exp_field = (mag_code >> 3) as i32;
    let mantissa = (mag_code & 0x7) as f32;
    let mag = if exp_field == 0 {
        mantissa * pow2(-9)
    } else {
        (8.0 + mantissa) * pow2(exp_field - 7 - 3)
    };
    if code & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

/// Encodes `x` as bfloat16 bits: round to nearest, ties to even; overflow goes to
/// infinity (as IEEE rounding does); NaN stays NaN (quietened, sign kept).
pub fn bf16_encode(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    // Adding 0x7FFF plus the lowest kept bit rounds the dropped half to even.
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// Decodes bfloat16 bits to f32 (exact).
pub fn bf16_decode(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Rounds `x` to the nearest bfloat16 value, returned as f32.
pub fn bf16_round(x: f32) -> f32 {
    bf16_decode(bf16_encode(x))
}

/// Packs u16 values two per u32 word: element `2i` in the low half of word `i`,
/// element `2i + 1` in the high half; an odd tail is padded with zero.
pub fn pack_u16_words(v: &[u16]) -> Vec<u32> {
    v.chunks(2)
        .map(|pair| pair[0] as u32 | (pair.get(1).copied().unwrap_or(0) as u32) << 16)
        .collect()
}

/// Packs bytes four per u32 word, little-endian (byte `4i + j` in bits `8j..8j+8` of
/// word `i`); a short tail is padded with zeros.
pub fn pack_u8_words(v: &[u8]) -> Vec<u32> {
    v.chunks(4)
        .map(|chunk| {
            let mut bytes = [0u8; 4];
            bytes[..chunk.len()].copy_from_slice(chunk);
            u32::from_le_bytes(bytes)
        })
        .collect()
}

#[cfg(test)]
#[path = "formats_tests.rs"]
mod tests;
