//! Decoding of kiln's storage formats inside kernels, from raw bits held in `u32` words.
//!
//! Neither sm_90 nor WGSL has native FP4, and WGSL has no bf16 or fp8, so every kernel reads
//! packed words and decodes in registers. The decodings are exact and agree bit for bit with
//! `kiln_reference::formats`: E2M1 (codes 0-7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 sign),
//! FP8 E4M3FN (bias 7, subnormals, no NaN handling: scales and KV are finite by construction)
//! and bf16 (the high half of an f32).
use cubecl::prelude::*;

/// The f32 value of an E2M1 code (low 4 bits of `code`).
#[cube]
pub fn e2m1_to_f32(code: u32) -> f32 {
    let e = (code >> 1) & 3;
    let m = code & 1;
    // Normal codes (e > 0) are (2 + m) * 2^e / 4; e = 0 is the subnormal m / 2.
    let normal = f32::cast_from((2 + m) << e) * 0.25;
    let subnormal = f32::cast_from(m) * 0.5;
    let mag = select(e == 0, subnormal, normal);
    select((code & 8) != 0, -mag, mag)
}

/// The f32 value of an FP8 E4M3FN code (low 8 bits of `code`).
#[cube]
pub fn e4m3_to_f32(code: u32) -> f32 {
    let e = (code >> 3) & 15;
    let m = code & 7;
    // Normal: rebias the exponent (7 -> 127) and widen the mantissa (3 -> 23 bits).
    let normal = f32::reinterpret(((e + 120) << 23) | (m << 20));
    // Subnormal: m * 2^-9.
    let subnormal = f32::cast_from(m) * 0.001953125;
    let mag = select(e == 0, subnormal, normal);
    select((code & 128) != 0, -mag, mag)
}

/// The f32 value of bf16 bits (low 16 bits of `bits`).
#[cube]
pub fn bf16_to_f32(bits: u32) -> f32 {
    f32::reinterpret((bits & 0xffff) << 16)
}

/// Byte `index` of a byte stream packed little-endian into `u32` words.
#[cube]
pub fn byte_at(words: &Array<u32>, index: usize) -> u32 {
    (words[index / 4] >> (((index % 4) * 8) as u32)) & 0xff
}

/// Half-word `index` of a u16 stream packed little-endian into `u32` words.
#[cube]
pub fn half_at(words: &Array<u32>, index: usize) -> u32 {
    (words[index / 2] >> (((index % 2) * 16) as u32)) & 0xffff
}
