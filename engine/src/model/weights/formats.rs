//! Decoding the stored forms of a linear weight into what kiln computes with.
//!
//! Detected per tensor from the names present next to `X.weight`:
//! - plain `X.weight` in bf16, f16 or f32;
//! - ModelOpt NVFP4: `X.weight` u8 `[out, in/2]`, `X.weight_scale` e4m3 `[out, in/16]`,
//!   `X.weight_scale_2` f32 (`amax / (6 * 448)`), `X.input_scale` (activations; unused here);
//! - compressed-tensors `nvfp4-pack-quantized`: `X.weight_packed` u8, `X.weight_scale` e4m3,
//!   `X.weight_global_scale` f32 stored as the reciprocal (`6 * 448 / amax`), turned into the
//!   multiplicative form (`1 / g`, within one f32 ulp of dividing by `g`);
//! - compressed-tensors INT4 `pack-quantized` (Kimi's release): `X.weight_packed` i32
//!   `[out, in/8]` (element `j` in bits `4j..4j+4`, stored as `q + 8`), `X.weight_scale` bf16
//!   `[out, in/32]`; `w = q * scale`. Converted to NVFP4 at load with the reference quantizer;
//!   the conversion is not exact (±5, ±7, -8 are not E2M1 values): 7.3% relative RMS error
//!   on normally distributed weights quantized to INT4 (measured by
//!   `int4_experts_convert_to_nvfp4_with_bounded_error` in `engine/tests/loading.rs`);
//! - DeepSeek-V3's block-scaled FP8: `X.weight` e4m3 `[out, in]`, `X.weight_scale_inv` f32
//!   `[ceil(out / bo), ceil(in / bi)]` for blocks `[bo, bi]` (the config's
//!   `weight_block_size`), multiplied in: `w = e4m3(code) * scale_inv[i / bo][j / bi]`.
//!   Dense layers are served from these values (bf16 on the device); routed experts are
//!   converted to NVFP4 at load like the INT4 ones (error measured by
//!   `fp8_experts_convert_to_nvfp4_with_bounded_error`).
use std::path::Path;

use kiln_core::formats::{bf16_decode, e4m3_decode};
use kiln_core::model::Tensor;
use kiln_core::nvfp4::Nvfp4Matrix;
use safetensors::Dtype;

use super::LoadError;

/// One stored tensor, viewed in its file.
pub struct RawTensor<'a> {
    pub path: &'a Path,
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl RawTensor<'_> {
    pub fn dtype_error(&self, expected: &str) -> LoadError {
        LoadError::Dtype {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            expected: expected.to_string(),
            got: format!("{:?}", self.dtype),
        }
    }

    pub fn shape_error(&self, expected: &[usize]) -> LoadError {
        LoadError::Shape {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            expected: expected.to_vec(),
            got: self.shape.to_vec(),
        }
    }

    /// Checks the shape, treating `[]` and `[1]` alike for scalars.
    pub fn expect_shape(&self, expected: &[usize]) -> Result<(), LoadError> {
        let scalar = |s: &[usize]| s.iter().product::<usize>() == 1 && s.len() <= 1;
        if self.shape == expected || (scalar(self.shape) && scalar(expected)) {
            Ok(())
        } else {
            Err(self.shape_error(expected))
        }
    }

    /// The values widened to f32 (bf16, f16 or f32 storage).
    pub fn to_f32(&self) -> Result<Vec<f32>, LoadError> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| bf16_decode(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            _ => return Err(self.dtype_error("BF16, F16 or F32")),
        })
    }

    fn raw_bytes(&self, dtype: Dtype, expected: &str) -> Result<Vec<u8>, LoadError> {
        if self.dtype == dtype {
            Ok(self.bytes.to_vec())
        } else {
            Err(self.dtype_error(expected))
        }
    }

    fn scalar_f32(&self) -> Result<f32, LoadError> {
        self.expect_shape(&[])?;
        Ok(self.to_f32()?[0])
    }
}

/// A linear weight as loaded: dense values, or NVFP4 codes and scales.
#[derive(Clone, Debug)]
pub enum LoadedWeight {
    Dense(Tensor),
    Nvfp4(Nvfp4Matrix),
}

impl LoadedWeight {
    /// The values as f32 (exact: NVFP4 dequantizes as `e2m1 * scale * global`).
    pub fn dequantize(&self) -> Tensor {
        match self {
            LoadedWeight::Dense(t) => t.clone(),
            LoadedWeight::Nvfp4(m) => Tensor {
                shape: vec![m.rows, m.cols],
                data: m.dequantize(),
            },
        }
    }
}

/// NVFP4 from its three parts (codes `[out, in/2]` u8, e4m3 scales `[out, in/16]`).
pub fn nvfp4(
    codes: &RawTensor,
    scales: &RawTensor,
    global_scale: f32,
    shape: [usize; 2],
) -> Result<Nvfp4Matrix, LoadError> {
    let [out, inp] = shape;
    if inp % 16 != 0 {
        return Err(codes.shape_error(&[out, inp / 2]));
    }
    codes.expect_shape(&[out, inp / 2])?;
    scales.expect_shape(&[out, inp / 16])?;
    if !global_scale.is_finite() || global_scale <= 0.0 {
        return Err(LoadError::Format {
            path: codes.path.to_path_buf(),
            tensor: codes.name.to_string(),
            reason: format!("global scale {global_scale} is not a positive finite number"),
        });
    }
    Ok(Nvfp4Matrix {
        rows: out,
        cols: inp,
        packed: codes.raw_bytes(Dtype::U8, "U8")?,
        scales: scales.raw_bytes(Dtype::F8_E4M3, "F8_E4M3")?,
        global_scale,
    })
}

/// ModelOpt NVFP4: `weight_scale_2` is the multiplicative global scale.
pub fn modelopt(
    w: &RawTensor,
    s: &RawTensor,
    s2: &RawTensor,
    shape: [usize; 2],
) -> Result<Nvfp4Matrix, LoadError> {
    nvfp4(w, s, s2.scalar_f32()?, shape)
}

/// compressed-tensors NVFP4: `weight_global_scale` is stored as the reciprocal.
pub fn ct_nvfp4(
    w: &RawTensor,
    s: &RawTensor,
    g: &RawTensor,
    shape: [usize; 2],
) -> Result<Nvfp4Matrix, LoadError> {
    nvfp4(w, s, 1.0 / g.scalar_f32()?, shape)
}

/// compressed-tensors INT4 (symmetric, group 32, bf16 scales), dequantized to f32.
pub fn ct_int4(
    packed: &RawTensor,
    scale: &RawTensor,
    shape: [usize; 2],
) -> Result<Vec<f32>, LoadError> {
    let [out, inp] = shape;
    if inp % 32 != 0 {
        return Err(scale.shape_error(&[out, inp / 32]));
    }
    packed.expect_shape(&[out, inp / 8])?;
    scale.expect_shape(&[out, inp / 32])?;
    if packed.dtype != Dtype::I32 {
        return Err(packed.dtype_error("I32"));
    }
    let scales = scale.to_f32()?;
    let words = packed
        .bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    let mut w = Vec::with_capacity(out * inp);
    for (i, word) in words.enumerate() {
        for j in 0..8 {
            let q = ((word >> (4 * j)) & 0xf) as i32 - 8;
            let idx = i * 8 + j;
            w.push(q as f32 * scales[(idx / inp) * (inp / 32) + (idx % inp) / 32]);
        }
    }
    Ok(w)
}

/// DeepSeek-V3's block-scaled FP8, dequantized to f32.
pub fn fp8_block(
    weight: &RawTensor,
    scale_inv: &RawTensor,
    shape: [usize; 2],
    block: [usize; 2],
) -> Result<Vec<f32>, LoadError> {
    let [out, inp] = shape;
    let [bo, bi] = block;
    weight.expect_shape(&[out, inp])?;
    let (rows, cols) = (out.div_ceil(bo), inp.div_ceil(bi));
    scale_inv.expect_shape(&[rows, cols])?;
    if weight.dtype != Dtype::F8_E4M3 {
        return Err(weight.dtype_error("F8_E4M3"));
    }
    if scale_inv.dtype != Dtype::F32 {
        return Err(scale_inv.dtype_error("F32"));
    }
    let scales = scale_inv.to_f32()?;
    if let Some(bad) = scales.iter().find(|s| !s.is_finite() || **s <= 0.0) {
        return Err(LoadError::Format {
            path: scale_inv.path.to_path_buf(),
            tensor: scale_inv.name.to_string(),
            reason: format!("block scale {bad} is not a positive finite number"),
        });
    }
    Ok((weight.bytes.iter().enumerate())
        .map(|(k, &code)| {
            let (i, j) = (k / inp, k % inp);
            e4m3_decode(code) * scales[(i / bo) * cols + j / bi]
        })
        .collect())
}
