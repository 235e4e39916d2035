//! Full-width models with pseudo-random weights generated on the device (no file, no host
//! copy of the weights): routed experts in NVFP4 and everything else in bf16, or
//! ([`SyntheticQuant::All`]) the shared experts, dense MLPs and attention projections in
//! NVFP4 too (`kv_b`, the router, embedding and lm_head stay bf16); norms at 1. For
//! benchmarks at the real shapes; their outputs mean nothing.
use cubecl::prelude::*;
use kiln_core::model::ModelConfig;
use kiln_kernels::fill::fill_random_bits;
use kiln_kernels::gemm::{nvfp4_layout, Bf16Weights, Nvfp4Weights};
use kiln_kernels::DeviceArray;
use kiln_kernels::Precision;

use super::{Attention, DeviceLinear, Ffn, GpuModel, Layer, Mlp, ModelError, Moe, QProj, Weights};

/// bf16 pairs with magnitudes in [2^-7, 2^-6) and random signs and mantissas.
const BF16_AND: u32 = 0x807f_807f;
const BF16_OR: u32 = 0x3c00_3c00;
/// E4M3 scales 0x30..0x37: 0.5 to 0.94.
const SCALE_AND: u32 = 0x0707_0707;
const SCALE_OR: u32 = 0x3030_3030;
/// Global scale: NVFP4 weights up to 6 * 0.94 * 0.004 = 0.0226.
const GLOBAL_SCALE: f32 = 0.004;

struct Filler<'a, R: Runtime> {
    client: &'a ComputeClient<R>,
    seed: u32,
    precision: Precision,
}

impl<R: Runtime> Filler<'_, R> {
    fn words(&mut self, len: usize, and: u32, or: u32) -> Result<DeviceArray<u32>, ModelError> {
        let buf = DeviceArray::uninit(self.client, len);
        self.seed = self.seed.wrapping_add(0x9e37_79b9);
        fill_random_bits(self.client, &buf, self.seed, and, or)?;
        Ok(buf)
    }

    fn bf16(&mut self, experts: usize, n: usize, k: usize) -> Result<DeviceLinear, ModelError> {
        let data = self.words(experts * n * k / 2, BF16_AND, BF16_OR)?;
        Ok(DeviceLinear::Bf16(Bf16Weights {
            data,
            experts,
            n,
            k,
        }))
    }

    fn nvfp4(&mut self, experts: usize, n: usize, k: usize) -> Result<DeviceLinear, ModelError> {
        let elems = experts * n * k;
        Ok(DeviceLinear::Nvfp4(Nvfp4Weights {
            packed: self.words(elems / 8, u32::MAX, 0)?,
            scales: self.words((elems / 16).div_ceil(4), SCALE_AND, SCALE_OR)?,
            global_scales: DeviceArray::upload(self.client, &vec![GLOBAL_SCALE; experts]),
            experts,
            n,
            k,
            // Random codes and positive, finite scales are valid in either layout.
            layout: nvfp4_layout(self.client, n, k, self.precision),
        }))
    }

    fn ones(&self, len: usize) -> DeviceArray<f32> {
        DeviceArray::upload(self.client, &vec![1.0f32; len])
    }

    fn mlp(
        &mut self,
        experts: usize,
        h: usize,
        inter: usize,
        nvfp4: bool,
    ) -> Result<Mlp, ModelError> {
        let mut make = |n, k| {
            if nvfp4 {
                self.nvfp4(experts, n, k)
            } else {
                self.bf16(experts, n, k)
            }
        };
        Ok(Mlp {
            gate: make(inter, h)?,
            up: make(inter, h)?,
            down: make(h, inter)?,
        })
    }
}

/// Which synthetic weights are NVFP4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyntheticQuant {
    /// The routed experts (as Kimi's release and NVIDIA's NVFP4 checkpoints ship them).
    Experts,
    /// Every projection but `kv_b`, the router and lm_head (the write-up quantized the
    /// shared experts too).
    All,
}

impl<R: Runtime> GpuModel<R> {
    /// A model of `c`'s shape with device-generated random weights (`kv_lora_rank` 512,
    /// `qk_rope_head_dim` 64, `q_lora_rank` set, as in DeepSeek-V3 and Kimi K2), routed
    /// experts in NVFP4, tensor cores where the device has them.
    pub fn synthetic(
        client: ComputeClient<R>,
        c: ModelConfig,
        seed: u32,
    ) -> Result<Self, ModelError> {
        Self::synthetic_with(
            client,
            c,
            seed,
            SyntheticQuant::Experts,
            Precision::default(),
        )
    }

    /// [`GpuModel::synthetic`] with a choice of NVFP4 weights and kernel precision.
    pub fn synthetic_with(
        client: ComputeClient<R>,
        c: ModelConfig,
        seed: u32,
        quant: SyntheticQuant,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        let Some(r) = c
            .q_lora_rank
            .filter(|_| c.kv_lora_rank == 512 && c.qk_rope_head_dim == 64)
        else {
            return Err(ModelError::Unsupported(
                "synthetic models take Kimi/DeepSeek-V3 attention dims".into(),
            ));
        };
        let mut f = Filler {
            client: &client,
            seed,
            precision,
        };
        let (h, heads) = (c.hidden_size, c.num_attention_heads);
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let all = quant == SyntheticQuant::All;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let mut proj = |n, k| {
                if all {
                    f.nvfp4(1, n, k)
                } else {
                    f.bf16(1, n, k)
                }
            };
            let (q_a, q_b, kv_a, o) = (
                proj(r, h)?,
                proj(heads * qk, r)?,
                proj(576, h)?,
                proj(h, heads * c.v_head_dim)?,
            );
            let attn = Attention {
                q: QProj::Lora {
                    a: q_a,
                    norm: f.ones(r),
                    b: q_b,
                },
                kv_a,
                kv_a_norm: f.ones(512),
                kv_b: f.words(
                    heads * (c.qk_nope_head_dim + c.v_head_dim) * 512 / 2,
                    BF16_AND,
                    BF16_OR,
                )?,
                o,
            };
            let ffn = if i < c.first_k_dense_replace {
                Ffn::Dense(f.mlp(1, h, c.intermediate_size, all)?)
            } else {
                let shared_inter = c.moe_intermediate_size * c.n_shared_experts;
                Ffn::Moe(Moe {
                    router: f.bf16(1, c.n_routed_experts, h)?,
                    bias: DeviceArray::upload(&client, &vec![0.0f32; c.n_routed_experts]),
                    experts: f.mlp(c.n_routed_experts, h, c.moe_intermediate_size, true)?,
                    shared: if shared_inter > 0 {
                        Some(f.mlp(1, h, shared_inter, all)?)
                    } else {
                        None
                    },
                })
            };
            layers.push(Layer {
                input_norm: f.ones(h),
                attn,
                post_norm: f.ones(h),
                ffn,
            });
        }
        let weights = Weights {
            embed: f.words(c.vocab_size * h / 2, BF16_AND, BF16_OR)?,
            layers,
            norm: f.ones(h),
            lm_head: f.bf16(1, c.vocab_size, h)?,
        };
        Ok(Self::assemble(client, c, weights, precision))
    }

    /// The device client the model runs on.
    pub fn client(&self) -> &ComputeClient<R> {
        &self.client
    }
}
