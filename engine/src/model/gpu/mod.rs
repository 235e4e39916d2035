//! The model on the device: weights uploaded once, a forward pass built from kiln's CubeCL
//! kernels (no burn on the hot path), driven by an explicit [`Batch`].
//!
//! Attention runs in the absorbed MLA form over a paged KV cache ([`KvPool`]); the routed
//! experts go through the grouped GEMM after a device-side dispatch; activations are f32,
//! weights bf16 or NVFP4 as loaded. The MLA kernels fix `kv_lora_rank = 512` and
//! `qk_rope_head_dim = 64` (DeepSeek-V3 and every Kimi K2): other values are refused.
mod attention;
mod batch;
mod forward;
#[cfg(feature = "cuda")]
mod graphs;
mod host_kv;
#[cfg(any(feature = "cuda", test))]
mod padded;
mod synthetic;
mod upload;

use std::sync::atomic::AtomicUsize;

use cubecl::prelude::*;
use kiln_core::model::ModelConfig;
use kiln_core::rope::{cos_sin_scale, inv_freq, softmax_scale};
use kiln_kernels::mla::{KvBShape, KvFormat, PagedKvCache, PER_HEAD_MIN_Q_LEN};
use kiln_kernels::moe::GateParams;
use kiln_kernels::{DeviceArray, KernelError, Precision};

use crate::model::tp::AllReduceStandIn;
pub use batch::{Batch, KvPool, Launched, LogitRows, RequestSlice, RowLogprobs, StepOutput};
pub(crate) use forward::RankStep;
pub use host_kv::{Copied, HostKv};
pub use synthetic::SyntheticQuant;

use upload::{vector, DeviceLinear};

use super::weights::{needed_tensors, progress_bar, Checkpoint, LoadError, LoadedWeight};
use indicatif::ProgressBar;
use kiln_core::model::Tensor;

/// Where [`GpuModel::load_from`] reads named weights: a checkpoint, or one tensor-parallel
/// rank's slice of it (`crate::model::tp`).
pub(crate) trait WeightSource {
    /// The architecture the weights are for.
    fn config(&self) -> &ModelConfig;
    /// A plain (never quantized) tensor, checked against `shape`.
    fn plain(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError>;
    /// A linear weight `[out, in]`, in whichever format it is stored.
    fn linear(&self, name: &str, shape: [usize; 2]) -> Result<LoadedWeight, LoadError>;
}

impl WeightSource for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.spec.arch
    }

    fn plain(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        Checkpoint::plain(self, name, shape)
    }

    fn linear(&self, name: &str, shape: [usize; 2]) -> Result<LoadedWeight, LoadError> {
        Checkpoint::linear(self, name, shape)
    }
}

/// What a model's decode graphs hold and have done ([`GpuModel::graph_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs kept.
    pub held: usize,
    /// Device memory they hold: the arena their steps' arrays are carved from, and what
    /// their recordings allocated outside it.
    pub held_bytes: u64,
    /// Graphs recorded so far, those dropped included (each one an eager step and a
    /// capture: a count that keeps rising in a steady load means shapes churn).
    pub recorded: u64,
    /// Decode steps replayed from a graph.
    pub replayed: u64,
}

/// Why the device model cannot be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("bad batch: {0}")]
    Batch(String),
    #[error("device error: {0}")]
    Device(String),
    #[error("CUDA graphs: {0}")]
    Graphs(String),
}

enum QProj {
    Lora {
        a: DeviceLinear,
        norm: DeviceArray<f32>,
        b: DeviceLinear,
    },
    Direct(DeviceLinear),
}

struct Attention {
    q: QProj,
    kv_a: DeviceLinear,
    kv_a_norm: DeviceArray<f32>,
    /// `kv_b_proj` in bf16 words, used by the absorption kernels.
    kv_b: DeviceArray<u32>,
    o: DeviceLinear,
}

struct Mlp {
    gate: DeviceLinear,
    up: DeviceLinear,
    down: DeviceLinear,
}

struct Moe {
    router: DeviceLinear,
    bias: DeviceArray<f32>,
    /// Experts of each projection, concatenated.
    experts: Mlp,
    shared: Option<Mlp>,
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

struct Layer {
    input_norm: DeviceArray<f32>,
    attn: Attention,
    post_norm: DeviceArray<f32>,
    ffn: Ffn,
}

/// The weights of a model on the device, before the derived state is added.
struct Weights {
    embed: DeviceArray<u32>,
    layers: Vec<Layer>,
    norm: DeviceArray<f32>,
    lm_head: DeviceLinear,
}

/// A DeepSeek-V3 / Kimi-K2 model resident on one device.
pub struct GpuModel<R: Runtime> {
    client: ComputeClient<R>,
    pub config: ModelConfig,
    embed: DeviceArray<u32>,
    layers: Vec<Layer>,
    norm: DeviceArray<f32>,
    lm_head: DeviceLinear,
    inv_freq: DeviceArray<f32>,
    rope_scale: f32,
    softmax_scale: f32,
    gate: GateParams,
    kv_b_shape: KvBShape,
    /// What the GEMM and attention kernels may round (see `kiln_kernels::Precision`).
    precision: Precision,
    /// Kernel launches issued so far (per model, for the step statistics).
    launches: AtomicUsize,
    /// Device work in place of the all-reduces a tensor-parallel rank would run (one GPU
    /// serving one rank's shapes); `None`: the model is whole.
    all_reduce: Option<AllReduceStandIn>,
    /// Requests of this many new tokens or more attend in MLA's per-head form (`None`: all
    /// absorbed); see `plan` for where the device keeps them absorbed.
    per_head_from: Option<usize>,
    /// Decode steps recorded as CUDA graphs (`None`: every step issued eagerly).
    #[cfg(feature = "cuda")]
    graphs: Option<std::sync::Mutex<graphs::StepGraphs>>,
}

impl<R: Runtime> GpuModel<R> {
    /// Uploads every weight of `ckpt` to the device of `client` (tensor cores where the
    /// device has them: `Precision::Bf16`).
    pub fn load(client: ComputeClient<R>, ckpt: &Checkpoint) -> Result<Self, ModelError> {
        Self::load_from(client, ckpt, Precision::default())
    }

    /// [`GpuModel::load`] at a chosen precision (`Exact`: f32 operands everywhere).
    pub fn load_with(
        client: ComputeClient<R>,
        ckpt: &Checkpoint,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        Self::load_from(client, ckpt, precision)
    }

    /// Uploads every weight `ckpt.config()` names, read from `ckpt`.
    pub(crate) fn load_from(
        client: ComputeClient<R>,
        ckpt: &impl WeightSource,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        let c = ckpt.config().clone();
        if c.kv_lora_rank != 512 || c.qk_rope_head_dim != 64 {
            return Err(ModelError::Unsupported(format!(
                "kv_lora_rank {} / qk_rope_head_dim {} (the MLA kernels take 512 / 64)",
                c.kv_lora_rank, c.qk_rope_head_dim
            )));
        }
        let cl = &client;
        let bar = progress_bar(needed_tensors(&c).len());
        let plain = |name: &str, shape: &[usize]| {
            bar.inc(1);
            ckpt.plain(name, shape).map(|t| vector(cl, &t))
        };
        let linear = |name: &str, n: usize, k: usize| -> Result<DeviceLinear, LoadError> {
            bar.inc(1);
            DeviceLinear::upload(cl, &ckpt.linear(name, [n, k])?, precision)
        };
        let mlp = |p: &str, inter: usize| -> Result<Mlp, LoadError> {
            Ok(Mlp {
                gate: linear(&format!("{p}.gate_proj.weight"), inter, c.hidden_size)?,
                up: linear(&format!("{p}.up_proj.weight"), inter, c.hidden_size)?,
                down: linear(&format!("{p}.down_proj.weight"), c.hidden_size, inter)?,
            })
        };
        let h = c.hidden_size;
        let heads = c.num_attention_heads;
        let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let q = match c.q_lora_rank {
                Some(r) => QProj::Lora {
                    a: linear(&format!("{a}.q_a_proj.weight"), r, h)?,
                    norm: plain(&format!("{a}.q_a_layernorm.weight"), &[r])?,
                    b: linear(&format!("{a}.q_b_proj.weight"), heads * qk, r)?,
                },
                None => QProj::Direct(linear(&format!("{a}.q_proj.weight"), heads * qk, h)?),
            };
            let kv_b_rows = heads * (c.qk_nope_head_dim + c.v_head_dim);
            let kv_b = ckpt
                .linear(&format!("{a}.kv_b_proj.weight"), [kv_b_rows, 512])?
                .dequantize();
            let attn = Attention {
                q,
                kv_a: linear(&format!("{a}.kv_a_proj_with_mqa.weight"), 576, h)?,
                kv_a_norm: plain(&format!("{a}.kv_a_layernorm.weight"), &[512])?,
                kv_b: DeviceArray::upload(cl, &upload::bf16_words(&kv_b.data)),
                o: linear(&format!("{a}.o_proj.weight"), h, heads * c.v_head_dim)?,
            };
            let ffn = if i < c.first_k_dense_replace {
                Ffn::Dense(mlp(&format!("{p}.mlp"), c.intermediate_size)?)
            } else {
                Ffn::Moe(load_moe(ckpt, cl, &p, &c, &bar, precision)?)
            };
            layers.push(Layer {
                input_norm: plain(&format!("{p}.input_layernorm.weight"), &[h])?,
                attn,
                post_norm: plain(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                ffn,
            });
        }
        let embed = ckpt.plain("model.embed_tokens.weight", &[c.vocab_size, h])?;
        bar.inc(1);
        let head_name = if c.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        };
        let embed = DeviceArray::upload(cl, &upload::bf16_words(&embed.data));
        let weights = Weights {
            embed,
            layers,
            norm: plain("model.norm.weight", &[h])?,
            lm_head: linear(head_name, c.vocab_size, h)?,
        };
        bar.finish_and_clear();
        Ok(Self::assemble(client, c, weights, precision))
    }

    /// The model from its weights; everything else is derived from the config.
    fn assemble(
        client: ComputeClient<R>,
        c: ModelConfig,
        w: Weights,
        precision: Precision,
    ) -> Self {
        let freqs: Vec<f32> = inv_freq(c.qk_rope_head_dim, &c.rope)
            .iter()
            .map(|&f| f as f32)
            .collect();
        GpuModel {
            embed: w.embed,
            layers: w.layers,
            norm: w.norm,
            lm_head: w.lm_head,
            inv_freq: DeviceArray::upload(&client, &freqs),
            rope_scale: cos_sin_scale(&c.rope) as f32,
            softmax_scale: softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, &c.rope) as f32,
            gate: GateParams {
                n_routed_experts: c.n_routed_experts,
                num_experts_per_tok: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor as f32,
            },
            kv_b_shape: KvBShape {
                heads: c.num_attention_heads,
                nope: c.qk_nope_head_dim,
                v: c.v_head_dim,
            },
            precision,
            launches: AtomicUsize::new(0),
            all_reduce: None,
            per_head_from: Some(PER_HEAD_MIN_Q_LEN),
            #[cfg(feature = "cuda")]
            graphs: None,
            config: c,
            client,
        }
    }

    /// This model as one rank of tensor parallelism over `ranks` GPUs on one GPU: after
    /// attention and after the MLP of every layer it runs device work of the modelled
    /// time of the all-reduce a rank would wait for there (see `model::tp::all_reduce`).
    pub fn with_all_reduce_stand_in(mut self, ranks: usize) -> Result<Self, ModelError> {
        self.all_reduce = Some(AllReduceStandIn::calibrate(&self.client, ranks)?);
        Ok(self)
    }

    /// Requests of `from` new tokens or more in a step attend in MLA's per-head form
    /// (`kiln_kernels::mla::mla_prefill_heads`), the rest absorbed; `None`: all absorbed.
    /// Where the absorbed kernels run on tensor cores, only shapes the per-head tensor-core
    /// kernel takes attend per head (`kiln_kernels::mla::heads_on_tensor_cores`).
    pub fn set_per_head_from(&mut self, from: Option<usize>) {
        self.per_head_from = from;
    }

    /// The fewest new tokens of a request that attend per head (`None`: none do).
    pub fn per_head_from(&self) -> Option<usize> {
        self.per_head_from
    }

    /// Without the `cuda` feature there is no routed runtime to record graphs on.
    #[cfg(not(feature = "cuda"))]
    pub fn enable_graphs(&mut self, _sizes: Vec<usize>) -> Result<(), ModelError> {
        Err(ModelError::Graphs(
            "they need a build with the cuda feature and the cuda-routed backend".into(),
        ))
    }

    /// Without the `cuda` feature graphs are always off.
    #[cfg(not(feature = "cuda"))]
    pub fn graph_stats(&self) -> Option<GraphStats> {
        None
    }

    /// A KV pool for this model: `num_pages` pages of `page_size` tokens per layer.
    pub fn kv_pool(&self, num_pages: usize, page_size: usize, format: KvFormat) -> KvPool {
        let words = num_pages * page_size * format.words_per_row();
        let caches = (0..self.config.num_hidden_layers)
            .map(|_| PagedKvCache {
                // Only rows the step itself wrote are ever read.
                data: DeviceArray::uninit(&self.client, words),
                format,
                page_size,
                num_pages,
            })
            .collect();
        KvPool {
            caches,
            page_size,
            num_pages,
        }
    }
}

fn load_moe<R: Runtime>(
    ckpt: &impl WeightSource,
    cl: &ComputeClient<R>,
    p: &str,
    c: &ModelConfig,
    bar: &ProgressBar,
    precision: Precision,
) -> Result<Moe, LoadError> {
    let (h, inter, e) = (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts);
    let experts = |proj: &str, shape: [usize; 2]| -> Result<DeviceLinear, LoadError> {
        let loaded = (0..e)
            .map(|j| {
                bar.inc(1);
                ckpt.linear(&format!("{p}.mlp.experts.{j}.{proj}.weight"), shape)
            })
            .collect::<Result<Vec<_>, _>>()?;
        DeviceLinear::upload_experts(cl, &loaded, precision)
    };
    let shared = if c.n_shared_experts > 0 {
        let si = inter * c.n_shared_experts;
        let sp = format!("{p}.mlp.shared_experts");
        let lin = |n: &str, shape| -> Result<DeviceLinear, LoadError> {
            bar.inc(1);
            DeviceLinear::upload(
                cl,
                &ckpt.linear(&format!("{sp}.{n}.weight"), shape)?,
                precision,
            )
        };
        Some(Mlp {
            gate: lin("gate_proj", [si, h])?,
            up: lin("up_proj", [si, h])?,
            down: lin("down_proj", [h, si])?,
        })
    } else {
        None
    };
    let router = ckpt.plain(&format!("{p}.mlp.gate.weight"), &[e, h])?;
    bar.inc(2);
    Ok(Moe {
        router: DeviceLinear::upload(cl, &LoadedWeight::Dense(router), precision)?,
        bias: vector(
            cl,
            &ckpt.plain(&format!("{p}.mlp.gate.e_score_correction_bias"), &[e])?,
        ),
        experts: Mlp {
            gate: experts("gate_proj", [inter, h])?,
            up: experts("up_proj", [inter, h])?,
            down: experts("down_proj", [h, inter])?,
        },
        shared,
    })
}
