//! The cases `kiln check` runs: each kernel on a few realistic (Kimi-K2-shaped) problems,
//! small enough for a software adapter to finish in about a minute.
use cubecl::prelude::*;
use kiln_kernels::mla::KvFormat;
use kiln_kernels::KernelError;

use crate::gemm::{run_gemm, GemmCase};
use crate::mla::{run_mla, AttnMode, MlaCase};
use crate::tree::{run_tree, TreeCase};
use crate::CaseReport;

/// One case of any kernel family.
#[derive(Clone, Debug)]
pub enum Case {
    Gemm(GemmCase),
    Mla(MlaCase),
    Tree(TreeCase),
}

impl Case {
    /// Runs on the device (activations in f32 for the GEMM) and compares with the reference.
    pub fn run<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        timing: bool,
    ) -> Result<CaseReport, KernelError> {
        match self {
            Case::Gemm(c) => run_gemm::<R, f32>(client, c, timing),
            Case::Mla(c) => run_mla(client, c, timing),
            Case::Tree(c) => run_tree(client, c, timing),
        }
    }
}

/// Kimi-K2 shapes: the attention output projection and a routed expert's down projection
/// at decode batch sizes, a few experts of a grouped MoE step, 16-head MLA decode over
/// thousands of cached tokens in both KV formats, an extend over a cached prefix, and a
/// batch of 64-node draft trees over the full vocabulary.
pub fn realistic_cases() -> Vec<Case> {
    let mla = |heads, q_lens: Vec<usize>, kv_lens: Vec<usize>, format, mode, seed| {
        Case::Mla(MlaCase {
            heads,
            page_size: 64,
            q_lens,
            kv_lens,
            format,
            mode,
            seed,
            huge_tile: false,
            tree: false,
        })
    };
    vec![
        Case::Gemm(GemmCase::dense(1, 7168, 2048, 1)),
        Case::Gemm(GemmCase::dense(4, 2048, 7168, 2)),
        Case::Gemm(GemmCase::grouped(
            vec![3, 0, 1, 4, 2, 0, 5, 1],
            512,
            2048,
            3,
        )),
        mla(
            16,
            vec![1; 4],
            vec![4096, 1500, 777, 64],
            KvFormat::Bf16,
            AttnMode::Decode,
            4,
        ),
        mla(
            16,
            vec![1; 4],
            vec![4096, 1500, 777, 64],
            KvFormat::Fp8,
            AttnMode::Decode,
            5,
        ),
        mla(
            16,
            vec![8, 8],
            vec![2048, 301],
            KvFormat::Bf16,
            AttnMode::Decode,
            6,
        ),
        mla(
            8,
            vec![256, 33],
            vec![1280, 33],
            KvFormat::Bf16,
            AttnMode::Prefill,
            7,
        ),
        Case::Tree(TreeCase {
            batch: 64,
            nodes: 64,
            vocab: 163840,
            stochastic: false,
            seed: 8,
            cubes: None,
        }),
        Case::Tree(TreeCase {
            batch: 4,
            nodes: 16,
            vocab: 32768,
            stochastic: true,
            seed: 9,
            cubes: None,
        }),
    ]
}
