//! Tensor parallelism on one device: the model sliced over N ranks ([`ShardedModel`], the
//! ranks run one after another, all-reduced on the host) against the unsharded device model
//! ([`GpuModel`], TP = 1), on every enabled backend: prefill of whole sequences and ragged
//! decode batches over the paged KV cache, on the HF fixtures with Kimi's MLA dimensions
//! (2 heads: TP = 2, bf16 and NVFP4 experts) and on an 8-head checkpoint written here
//! (TP = 4 and 8, NVFP4 experts sliced down to one 16-element scale block of K per rank).
//!
//! The bound: every logit within bf16's unit roundoff (`2^-8`) of its row's largest TP = 1
//! logit. TP = N only reassociates the f32 sums of the row-parallel projections (`o_proj`,
//! `down_proj`), so both sides lie within the same f32 rounding bound of exact arithmetic
//! (`kiln_reference::tolerance`, Higham Thm 3.1), orders of magnitude inside `2^-8`; the
//! bound is the bf16 rounding of the logits, the one the HF conformance tests use
//! (`engine/tests/hf_conformance.rs`). The worst ratio to it is printed.
mod common;

use std::path::{Path, PathBuf};

use cubecl::prelude::*;
use kiln::model::gpu::{Batch, GpuModel, LogitRows, RequestSlice};
use kiln::model::tp::{shard, ShardedModel, SliceError, TpError};
use kiln::model::{Checkpoint, ModelSpec};
use kiln_kernels::mla::KvFormat;
use kiln_reference::data::Rng;
use kiln_reference::tolerance::{compare, DType};

use common::{quant_fragment, spec_tensors, write_checkpoint_with_config, ExpertFormat};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

/// Kimi's MLA dimensions (kv_lora_rank 512, rope 64) with 8 heads, small elsewhere.
const EIGHT_HEADS: &str = r#"{
  "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 128,
  "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 8, "q_lora_rank": 64, "kv_lora_rank": 512,
  "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
  "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1,
  "topk_group": 1, "norm_topk_prob": true, "routed_scaling_factor": 2.5,
  "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
  "max_position_embeddings": 128, "tie_word_embeddings": false QUANT
}"#;

/// The 8-head checkpoint with ModelOpt NVFP4 experts, written to a temporary directory.
fn eight_heads() -> tempfile::TempDir {
    eight_heads_with(&EIGHT_HEADS.replace("QUANT", quant_fragment(ExpertFormat::ModelOptNvfp4)))
}

/// A checkpoint of `config` with ModelOpt NVFP4 experts, in a temporary directory.
fn eight_heads_with(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let spec = ModelSpec::from_json(config).unwrap();
    let (tensors, _) = spec_tensors(&spec, ExpertFormat::ModelOptNvfp4, 29);
    write_checkpoint_with_config(dir.path(), config, &tensors);
    dir
}

/// Asserts every logit of `got` within `2^-8` of its row's largest `want`; returns the
/// worst error as a share of that bound.
fn within_bf16(what: &str, got: &[f32], want: &[f32], vocab: usize) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: logits of different shapes");
    let allowed: Vec<f64> = want
        .chunks(vocab)
        .flat_map(|row| {
            let scale = row.iter().fold(0.0f64, |m, &x| m.max((x as f64).abs()));
            std::iter::repeat_n(DType::BF16.unit_roundoff() * scale, vocab)
        })
        .collect();
    let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    let c = compare(got, &want, &allowed);
    assert!(c.passed(), "{what}: {c}");
    c.worst_ratio
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// One sequence prefilled at once, pages handed out in reverse so the block table matters.
fn prefill_agrees<R: Runtime>(one: &GpuModel<R>, tp: &ShardedModel<R>, tokens: &[u32]) -> f64 {
    let page = 4;
    let pages = tokens.len().div_ceil(page);
    let batch = Batch::new(vec![RequestSlice {
        tokens: tokens.to_vec(),
        kv_len: tokens.len(),
        block_table: (0..pages as u32).rev().map(|p| p + 1).collect(),
        tree: None,
    }]);
    let want = one
        .forward(&batch, &one.kv_pool(pages + 2, page, KvFormat::F32))
        .unwrap();
    let got = tp
        .forward(&batch, &tp.kv_pool(pages + 2, page, KvFormat::F32))
        .unwrap();
    within_bf16("prefill", &got, &want, tp.config.vocab_size)
}

/// Two requests of different lengths prefilled together, then decoded together one token
/// a step (each request's last logits only, as serving asks), over a bf16 cache of 2-token
/// pages, interleaved between the requests.
fn decode_agrees<R: Runtime>(one: &GpuModel<R>, tp: &ShardedModel<R>, rng: &mut Rng) -> f64 {
    let (vocab, page, steps) = (tp.config.vocab_size, 2, 5);
    let mut contexts = [random_tokens(rng, 7, vocab), random_tokens(rng, 4, vocab)];
    let pages_each = (7 + steps).div_ceil(page);
    let tables: Vec<Vec<u32>> = (0..2u32)
        .map(|b| (0..pages_each as u32).map(|p| 2 * p + b).collect())
        .collect();
    let (pool_one, pool_tp) = (
        one.kv_pool(2 * pages_each, page, KvFormat::Bf16),
        tp.kv_pool(2 * pages_each, page, KvFormat::Bf16),
    );
    let mut worst = 0.0f64;
    let mut new: Vec<usize> = contexts.iter().map(Vec::len).collect();
    for step in 0..=steps {
        let requests = contexts
            .iter()
            .zip(&new)
            .zip(&tables)
            .map(|((ctx, &n), table)| RequestSlice {
                tokens: ctx[ctx.len() - n..].to_vec(),
                kv_len: ctx.len(),
                block_table: table.clone(),
                tree: None,
            })
            .collect();
        let mut batch = Batch::new(requests);
        batch.logits = LogitRows::Last;
        let want = one.forward(&batch, &pool_one).unwrap();
        let got = tp.forward(&batch, &pool_tp).unwrap();
        let what = format!("decode step {step}");
        worst = worst.max(within_bf16(&what, &got, &want, vocab));
        for (ctx, row) in contexts.iter_mut().zip(want.chunks(vocab)) {
            let argmax = (0..vocab)
                .max_by(|&i, &j| row[i].total_cmp(&row[j]))
                .unwrap();
            ctx.push(argmax as u32);
        }
        new = vec![1, 1];
    }
    worst
}

fn tp_matches_one_rank<R: Runtime>(client: &ComputeClient<R>, dir: &Path, ranks: usize) {
    let ckpt = Checkpoint::open(dir).unwrap();
    let one = GpuModel::load(client.clone(), &ckpt).unwrap();
    let tp = ShardedModel::load(client.clone(), &ckpt, ranks).unwrap();
    assert_eq!(tp.ranks(), ranks);
    let mut rng = Rng::new(ranks as u64);
    let tokens = random_tokens(&mut rng, 13, tp.config.vocab_size);
    let prefill = prefill_agrees(&one, &tp, &tokens);
    let decode = decode_agrees(&one, &tp, &mut rng);
    eprintln!(
        "{} TP={ranks}: worst error {prefill:.4} (prefill), {decode:.4} (decode) of the bf16 bound",
        dir.display()
    );
}

fn two_ranks_match_one_on_kimi_dimensions<R: Runtime>(client: &ComputeClient<R>) {
    tp_matches_one_rank(client, &fixture("tiny-kimi"), 2);
}

fn two_ranks_match_one_with_nvfp4_experts<R: Runtime>(client: &ComputeClient<R>) {
    tp_matches_one_rank(client, &fixture("tiny-kimi-nvfp4"), 2);
}

fn four_and_eight_ranks_match_one_on_an_eight_head_checkpoint<R: Runtime>(
    client: &ComputeClient<R>,
) {
    let dir = eight_heads();
    for ranks in [4, 8] {
        tp_matches_one_rank(client, dir.path(), ranks);
    }
}

/// With one rank, every kernel runs as in the unsharded model, on the same values: the
/// pieces the sharded forward is built from add nothing to the arithmetic.
fn one_rank_reproduces_the_unsharded_model_bit_for_bit<R: Runtime>(client: &ComputeClient<R>) {
    let ckpt = Checkpoint::open(&fixture("tiny-kimi")).unwrap();
    let one = GpuModel::load(client.clone(), &ckpt).unwrap();
    let tp = ShardedModel::load(client.clone(), &ckpt, 1).unwrap();
    let tokens = random_tokens(&mut Rng::new(5), 9, tp.config.vocab_size);
    let batch = Batch::new(vec![RequestSlice {
        tokens: tokens.clone(),
        kv_len: tokens.len(),
        block_table: vec![2, 0, 1],
        tree: None,
    }]);
    let want = one
        .forward(&batch, &one.kv_pool(3, 4, KvFormat::F32))
        .unwrap();
    let got = tp
        .forward(&batch, &tp.kv_pool(3, 4, KvFormat::F32))
        .unwrap();
    assert_eq!(got, want);
}

/// Splits that cannot be made, and batches the sharded forward cannot run, are refused
/// with the reason.
fn impossible_splits_and_bad_batches_are_refused<R: Runtime>(client: &ComputeClient<R>) {
    let ckpt = Checkpoint::open(&fixture("tiny-kimi")).unwrap();
    match ShardedModel::load(client.clone(), &ckpt, 4) {
        Err(TpError::Indivisible { what, .. }) => assert_eq!(what, "num_attention_heads"),
        other => panic!("expected Indivisible, got {:?}", other.err()),
    }
    assert!(matches!(
        ShardedModel::load(client.clone(), &ckpt, 0),
        Err(TpError::Rank { rank: 0, ranks: 0 })
    ));
    let tp = ShardedModel::load(client.clone(), &ckpt, 2).unwrap();
    let pool = tp.kv_pool(2, 4, KvFormat::F32);
    let one = |tokens: Vec<u32>| {
        Batch::new(vec![RequestSlice {
            kv_len: tokens.len(),
            tokens,
            block_table: vec![0],
            tree: None,
        }])
    };
    let err = tp.forward(&one(vec![3, 512]), &pool).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let mut capture = one(vec![3]);
    capture.capture = vec![0];
    assert!(matches!(
        tp.forward(&capture, &pool),
        Err(TpError::Unsupported(_))
    ));
    let other_pool = ShardedModel::load(client.clone(), &ckpt, 1)
        .unwrap()
        .kv_pool(2, 4, KvFormat::F32);
    assert!(matches!(
        tp.forward(&one(vec![3]), &other_pool),
        Err(TpError::Unsupported(_))
    ));
}

/// Experts 64 wide over 8 ranks leave 8 columns of each NVFP4 `down_proj` per rank, half a
/// scale block: refused, naming the tensor.
#[test]
fn nvfp4_experts_split_off_their_scale_blocks_are_refused() {
    let config = EIGHT_HEADS
        .replace("QUANT", quant_fragment(ExpertFormat::ModelOptNvfp4))
        .replace(
            r#""moe_intermediate_size": 128"#,
            r#""moe_intermediate_size": 64"#,
        );
    let dir = eight_heads_with(&config);
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    assert!(shard(&ckpt, 0, 4).is_ok());
    match shard(&ckpt, 1, 8) {
        Err(TpError::Slice { tensor, source }) => {
            assert_eq!(tensor, "model.layers.1.mlp.experts.0.down_proj.weight");
            assert_eq!(source, SliceError::UnalignedNvfp4 { start: 8, end: 16 });
        }
        other => panic!("expected an unaligned NVFP4 slice, got {:?}", other.err()),
    }
}

kiln_backends::backend_tests! {
    one_rank_reproduces_the_unsharded_model_bit_for_bit,
    two_ranks_match_one_on_kimi_dimensions,
    two_ranks_match_one_with_nvfp4_experts,
    four_and_eight_ranks_match_one_on_an_eight_head_checkpoint,
    impossible_splits_and_bad_batches_are_refused,
}
