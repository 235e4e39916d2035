//! `kiln serve --synthetic ARCH`: a model of a real architecture with weights generated on
//! the device, optionally cut to its first layers and to one tensor-parallel rank's shapes,
//! so serving at full width can be measured on one GPU without a checkpoint.
use clap::{Args, ValueEnum};
use kiln::engine::SyntheticSpec;
use kiln::model::default_model;
use kiln::model::gpu::SyntheticQuant;
use kiln::model::tp::{shard::rank_config, MODELLED_RANKS};
use kiln::model::ModelSpec;
use kiln_core::model::ModelConfig;

#[derive(Args)]
pub struct SyntheticArgs {
    /// Serve a synthetic model instead of a checkpoint: the named architecture at full
    /// width with weights generated on the device (routed experts NVFP4, the rest bf16),
    /// for benchmarks; its outputs mean nothing. Send token ids (/generate): text goes
    /// through the embedded model's 512-token tokenizer.
    #[arg(long, value_enum, value_name = "ARCH", conflicts_with = "model")]
    pub synthetic: Option<SyntheticArch>,
    /// With --synthetic: keep the first N decoder layers only (a Kimi MoE layer is about
    /// 9.7 GB in NVFP4), so the model fits one GPU and the KV pool takes the rest.
    #[arg(long, value_name = "N", requires = "synthetic")]
    pub layers: Option<usize>,
    /// With --synthetic: the shapes one rank of Megatron tensor parallelism over T GPUs
    /// holds (heads, every expert's and the dense MLP's intermediate width and the
    /// vocabulary split T ways), with the two all-reduces of each layer stood in for by
    /// device work of their modelled NVLink time (T = 2, 4 or 8).
    #[arg(long, value_name = "T", requires = "synthetic")]
    pub tp_rank_of: Option<usize>,
    /// With --synthetic: the shared experts, dense MLPs and attention projections in NVFP4
    /// too (kv_b, the router, embedding and lm_head stay bf16).
    #[arg(long, requires = "synthetic")]
    pub nvfp4_all: bool,
}

/// The architectures `--synthetic` knows.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SyntheticArch {
    /// Kimi K2.x (K2, K2.5, K2.6): 61 layers, 64 heads, 384 experts, context 262,144.
    #[value(name = "kimi-k2.6", alias = "kimi-k2")]
    KimiK2,
    /// DeepSeek-V3: 61 layers, 128 heads, 256 experts, context 163,840.
    DeepseekV3,
    /// The embedded default model's architecture (2 layers, hidden 128): for tests.
    Tiny,
}

impl SyntheticArch {
    fn config(self) -> (ModelConfig, usize) {
        match self {
            SyntheticArch::KimiK2 => (ModelConfig::kimi_k2(), 262_144),
            SyntheticArch::DeepseekV3 => (ModelConfig::deepseek_v3(), 163_840),
            SyntheticArch::Tiny => {
                let spec = ModelSpec::from_json(default_model::CONFIG)
                    .expect("the embedded config parses");
                (spec.arch, spec.context_len)
            }
        }
    }
}

impl SyntheticArgs {
    /// The name the model is served under: `synthetic-ARCH[-Nl][-tpT-rank][-nvfp4]`.
    pub fn name(&self) -> String {
        let arch = self
            .synthetic
            .and_then(|a| a.to_possible_value())
            .map_or("none".into(), |v| v.get_name().to_string());
        let mut name = format!("synthetic-{arch}");
        if let Some(n) = self.layers {
            name += &format!("-{n}l");
        }
        if let Some(t) = self.tp_rank_of {
            name += &format!("-tp{t}-rank");
        }
        if self.nvfp4_all {
            name += "-nvfp4";
        }
        name
    }

    /// The synthetic model these flags describe, if any; a clear error for impossible cuts.
    pub fn spec(&self) -> anyhow::Result<Option<SyntheticSpec>> {
        let Some(arch) = self.synthetic else {
            return Ok(None);
        };
        let (mut config, context_len) = arch.config();
        if let Some(n) = self.layers {
            let all = config.num_hidden_layers;
            anyhow::ensure!(
                (1..=all).contains(&n),
                "--layers must be 1 to {all} for {arch:?}, got {n}"
            );
            config = config.first_layers(n);
        }
        if let Some(t) = self.tp_rank_of {
            anyhow::ensure!(
                MODELLED_RANKS.contains(&t),
                "--tp-rank-of must be one of {MODELLED_RANKS:?} (the TP sizes whose all-reduce \
                 time is modelled), got {t}"
            );
            config =
                rank_config(&config, t).map_err(|e| anyhow::anyhow!("--tp-rank-of {t}: {e}"))?;
        }
        Ok(Some(SyntheticSpec {
            config,
            quant: if self.nvfp4_all {
                SyntheticQuant::All
            } else {
                SyntheticQuant::Experts
            },
            context_len,
            seed: 0x6b69_6c6e,
            tp_ranks: self.tp_rank_of,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(arch: SyntheticArch, layers: Option<usize>, tp: Option<usize>) -> SyntheticArgs {
        SyntheticArgs {
            synthetic: Some(arch),
            layers,
            tp_rank_of: tp,
            nvfp4_all: false,
        }
    }

    #[test]
    fn a_rank_has_the_shapes_model_tp_slices_to() {
        let spec = args(SyntheticArch::KimiK2, Some(4), Some(4))
            .spec()
            .unwrap()
            .unwrap();
        let mut whole = ModelConfig::kimi_k2();
        whole.num_hidden_layers = 4;
        assert_eq!(spec.config, rank_config(&whole, 4).unwrap());
        let c = &spec.config;
        assert_eq!(
            (
                c.num_attention_heads,
                c.moe_intermediate_size,
                c.intermediate_size,
                c.vocab_size
            ),
            (16, 512, 4608, 163_840 / 4 + 1)
        );
        assert_eq!((c.num_hidden_layers, c.first_k_dense_replace), (4, 1));
        assert_eq!(spec.tp_ranks, Some(4));
        assert_eq!(spec.context_len, 262_144);
    }

    #[test]
    fn impossible_cuts_are_clear_errors() {
        let err = |a: SyntheticArgs| a.spec().unwrap_err().to_string();
        assert!(
            err(args(SyntheticArch::KimiK2, Some(0), None)).contains("--layers must be 1 to 61")
        );
        assert!(err(args(SyntheticArch::KimiK2, Some(62), None)).contains("--layers"));
        assert!(
            err(args(SyntheticArch::KimiK2, None, Some(3))).contains("--tp-rank-of must be one of")
        );
        // The tiny model's 2 heads do not split 4 ways.
        let e = err(args(SyntheticArch::Tiny, None, Some(4)));
        assert!(
            e.contains("--tp-rank-of 4") && e.contains("num_attention_heads"),
            "{e}"
        );
    }
}
