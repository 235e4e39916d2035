//! Moving loaded weights to the device in the layouts the kernels take: bf16 pairs in words,
//! NVFP4 codes and scales in words with f32 global scales, experts concatenated.
use cubecl::prelude::*;
use kiln_core::formats::{bf16_encode, pack_u16_words};
use kiln_core::model::Tensor;
use kiln_core::nvfp4::Nvfp4Matrix;
use kiln_kernels::gemm::{Bf16Weights, Nvfp4Weights, Operand};
use kiln_kernels::{DeviceArray, KernelError, Precision};

use crate::model::weights::{LoadError, LoadedWeight};

/// A projection (or a set of experts) on the device, in either weight format.
pub enum DeviceLinear {
    Bf16(Bf16Weights),
    Nvfp4(Nvfp4Weights),
}

/// bf16 words of f32 values (exact for values loaded from bf16).
pub fn bf16_words(values: &[f32]) -> Vec<u32> {
    let bits: Vec<u16> = values.iter().map(|&v| bf16_encode(v)).collect();
    pack_u16_words(&bits)
}

/// An f32 vector (norm weights, biases) on the device.
pub fn vector<R: Runtime>(client: &ComputeClient<R>, t: &Tensor) -> DeviceArray<f32> {
    DeviceArray::upload(client, &t.data)
}

impl DeviceLinear {
    /// Uploads one expert or projection (`[n, k]`).
    pub fn upload<R: Runtime>(
        client: &ComputeClient<R>,
        w: &LoadedWeight,
        precision: Precision,
    ) -> Result<Self, LoadError> {
        Self::upload_experts(client, std::slice::from_ref(w), precision)
    }

    /// Uploads experts of one projection, concatenated (all in the same format; dense
    /// experts mixed with NVFP4 ones are stored as bf16 after dequantizing). NVFP4 goes in
    /// the layout the device's kernels read fastest at `precision` (`Nvfp4Weights::upload`).
    pub fn upload_experts<R: Runtime>(
        client: &ComputeClient<R>,
        experts: &[LoadedWeight],
        precision: Precision,
    ) -> Result<Self, LoadError> {
        let all_nvfp4: Option<Vec<&Nvfp4Matrix>> = experts
            .iter()
            .map(|w| match w {
                LoadedWeight::Nvfp4(m) => Some(m),
                LoadedWeight::Dense(_) => None,
            })
            .collect();
        if let Some(mats) = all_nvfp4 {
            let packed: Vec<u32> = mats.iter().flat_map(|m| m.packed_words()).collect();
            let scales: Vec<u8> = mats.iter().flat_map(|m| m.scales.iter().copied()).collect();
            let globals: Vec<f32> = mats.iter().map(|m| m.global_scale).collect();
            let (n, k) = (mats[0].rows, mats[0].cols);
            let experts = mats.len();
            let w =
                Nvfp4Weights::upload(client, &packed, &scales, &globals, experts, n, k, precision)?;
            return Ok(DeviceLinear::Nvfp4(w));
        }
        let dense: Vec<Tensor> = experts.iter().map(LoadedWeight::dequantize).collect();
        let values: Vec<f32> = dense.iter().flat_map(|t| t.data.iter().copied()).collect();
        Ok(DeviceLinear::Bf16(Bf16Weights {
            data: DeviceArray::upload(client, &bf16_words(&values)),
            experts: dense.len(),
            n: dense[0].shape[0],
            k: dense[0].shape[1],
        }))
    }

    /// Output width.
    pub fn n(&self) -> usize {
        match self {
            DeviceLinear::Bf16(w) => w.n,
            DeviceLinear::Nvfp4(w) => w.n,
        }
    }

    /// The weights as the kernels' operand.
    pub fn operand(&self) -> Operand<'_> {
        match self {
            DeviceLinear::Bf16(w) => Operand::Bf16(w),
            DeviceLinear::Nvfp4(w) => Operand::Nvfp4(w),
        }
    }

    /// `out[m, n] = x[m, k] w^T`.
    pub fn apply<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        x: &DeviceArray<f32>,
        m: usize,
        out: &DeviceArray<f32>,
        precision: Precision,
    ) -> Result<(), KernelError> {
        self.operand().gemm(client, x, m, None, out, precision)
    }

    /// Grouped over experts: rows of `x` sorted by expert, `offsets` on the device.
    pub fn apply_grouped<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        x: &DeviceArray<f32>,
        m: usize,
        offsets: &DeviceArray<u32>,
        out: &DeviceArray<f32>,
        precision: Precision,
    ) -> Result<(), KernelError> {
        self.operand()
            .gemm(client, x, m, Some(offsets), out, precision)
    }
}
