//! The weight operands on the device: NVFP4 (row-major or in the MMA fragment layout) and
//! bf16, their validation, upload, and which kernel a GEMM over them runs.
use cubecl::prelude::*;

use super::{fragments, gemm_path, GemmPath, Nvfp4Layout, WeightFormat, BLOCK};
use crate::buffer::{check_index_space, check_len};
use crate::{DeviceArray, KernelError, Precision};

/// `experts` NVFP4 matrices of shape `[n, k]` on the device (`experts = 1` for a dense layer).
pub struct Nvfp4Weights {
    /// E2M1 codes, eight per word, expert after expert; within an expert, `layout` says
    /// where a code sits (row-major: element `8w + j` in bits `4j..4j + 4` of word `w`).
    pub packed: DeviceArray<u32>,
    /// E4M3 block-scale bytes, four per word (little-endian), expert after expert
    /// (row-major: `[experts, n, k / 16]`).
    pub scales: DeviceArray<u32>,
    /// One f32 global scale per expert (`amax / (6 * 448)`).
    pub global_scales: DeviceArray<f32>,
    pub experts: usize,
    pub n: usize,
    pub k: usize,
    pub layout: Nvfp4Layout,
}

/// `experts` bf16 matrices `[n, k]` on the device, two values per word (element `2i` in the
/// low half), expert after expert (`experts = 1` for a dense layer).
pub struct Bf16Weights {
    pub data: DeviceArray<u32>,
    pub experts: usize,
    pub n: usize,
    pub k: usize,
}

fn range_error(what: &'static str, value: usize) -> KernelError {
    KernelError::Range {
        what,
        value,
        min: 1,
        max: u32::MAX as usize,
    }
}

impl Nvfp4Weights {
    /// Checks the weights' buffers against their declared shape.
    pub fn validate(&self) -> Result<(), KernelError> {
        if self.k == 0 || !self.k.is_multiple_of(BLOCK) {
            return Err(KernelError::Alignment {
                what: "K",
                value: self.k,
                multiple: BLOCK,
            });
        }
        if self.n == 0 {
            return Err(range_error("N", 0));
        }
        if self.experts == 0 {
            return Err(range_error("experts", 0));
        }
        let elems = self.experts * self.n * self.k;
        // Scales are addressed by byte, codes by word.
        check_index_space("NVFP4 scale bytes", elems / BLOCK)?;
        check_len("NVFP4 packed codes (u32 words)", &self.packed, elems / 8)?;
        check_len(
            "NVFP4 block scales (u32 words)",
            &self.scales,
            (elems / BLOCK).div_ceil(4),
        )?;
        check_len("NVFP4 global scales", &self.global_scales, self.experts)?;
        if self.layout == Nvfp4Layout::Fragments && !fragments::shape_fits(self.n, self.k) {
            return Err(KernelError::Alignment {
                what: "N and K of fragment-layout NVFP4 weights (16 and 64)",
                value: self.n * self.k,
                multiple: fragments::TILE_ROWS * fragments::TILE_K,
            });
        }
        Ok(())
    }

    /// Uploads `experts` row-major matrices (codes eight per word, scale bytes
    /// `[experts, n, k / 16]`, one global scale per expert) in the layout this device's
    /// kernels read fastest at `precision` ([`nvfp4_layout`]; re-laid out on the device).
    #[allow(clippy::too_many_arguments)]
    pub fn upload<R: Runtime>(
        client: &ComputeClient<R>,
        codes: &[u32],
        scale_bytes: &[u8],
        global_scales: &[f32],
        experts: usize,
        n: usize,
        k: usize,
        precision: Precision,
    ) -> Result<Self, KernelError> {
        let row_major = Nvfp4Weights {
            packed: DeviceArray::upload(client, codes),
            scales: DeviceArray::upload(client, &pack_bytes(scale_bytes)),
            global_scales: DeviceArray::upload(client, global_scales),
            experts,
            n,
            k,
            layout: Nvfp4Layout::RowMajor,
        };
        row_major.validate()?;
        if nvfp4_layout(client, n, k, precision) == Nvfp4Layout::Fragments
            && fragments::fragments_hold(scale_bytes)
        {
            fragments::to_fragments(client, &row_major)
        } else {
            Ok(row_major)
        }
    }

    /// Which kernel a GEMM of `m` rows over these weights runs on this device.
    pub fn path<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        m: usize,
        grouped: bool,
        precision: Precision,
    ) -> GemmPath {
        let fragments = self.layout == Nvfp4Layout::Fragments;
        gemm_path(
            client,
            m,
            self.n,
            self.k,
            WeightFormat::Nvfp4,
            fragments,
            grouped.then_some(self.experts),
            precision,
        )
    }
}

/// Bytes packed little-endian into words (the last word zero-padded).
fn pack_bytes(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(4)
        .map(|c| c.iter().rev().fold(0u32, |w, &b| (w << 8) | b as u32))
        .collect()
}

/// The layout [`Nvfp4Weights::upload`] gives `[n, k]` matrices with finite, non-negative
/// block scales on this device: fragments where the tensor-core kernels run (`Bf16`
/// precision) and the shape tiles, row-major elsewhere.
pub fn nvfp4_layout<R: Runtime>(
    client: &ComputeClient<R>,
    n: usize,
    k: usize,
    precision: Precision,
) -> Nvfp4Layout {
    if precision == Precision::Bf16
        && fragments::shape_fits(n, k)
        && crate::tensor_cores::has_bf16_mma(client)
    {
        Nvfp4Layout::Fragments
    } else {
        Nvfp4Layout::RowMajor
    }
}

impl Bf16Weights {
    /// Checks the buffer against the declared shape (K even: rows start on a word).
    pub fn validate(&self) -> Result<(), KernelError> {
        if self.k == 0 || !self.k.is_multiple_of(2) {
            return Err(KernelError::Alignment {
                what: "K (bf16 weights)",
                value: self.k,
                multiple: 2,
            });
        }
        if self.n == 0 {
            return Err(range_error("N", 0));
        }
        if self.experts == 0 {
            return Err(range_error("experts", 0));
        }
        // bf16 weights are addressed by element.
        check_index_space("bf16 weight elements", self.experts * self.n * self.k)?;
        check_len(
            "bf16 weights (u32 words)",
            &self.data,
            self.experts * self.n * self.k / 2,
        )
    }

    /// Which kernel a GEMM of `m` rows over these weights runs on this device.
    pub fn path<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        m: usize,
        grouped: bool,
        precision: Precision,
    ) -> GemmPath {
        gemm_path(
            client,
            m,
            self.n,
            self.k,
            WeightFormat::Bf16,
            false,
            grouped.then_some(self.experts),
            precision,
        )
    }
}
