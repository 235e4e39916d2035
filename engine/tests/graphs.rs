//! Decode steps replayed from CUDA graphs (`GpuModel::enable_graphs`, the `cuda-routed`
//! backend) against the same steps issued eagerly, on the tiny Kimi fixture (NVFP4
//! experts, an fp8 cache). CUDA only.
#![cfg(feature = "cuda")]

use std::path::Path;

use kiln::model::gpu::{Batch, GpuModel, KvPool, RequestSlice};
use kiln::model::Checkpoint;
use kiln_backends::{Backend, CudaRouted};
use kiln_core::sampling::SamplingRow;
use kiln_kernels::mla::KvFormat;
use kiln_kernels::Precision;

type Model = GpuModel<kiln_backends::routed::KilnCuda>;

const PAGE: usize = 4;
/// Pages of each request's own region of the pool.
const PAGES: usize = 16;

fn checkpoint() -> Checkpoint {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tiny-kimi-nvfp4");
    Checkpoint::open(&dir).unwrap()
}

fn model(graphs: Option<Vec<usize>>) -> Model {
    let ckpt = checkpoint();
    let mut model = GpuModel::load_with(CudaRouted::client(), &ckpt, Precision::Bf16).unwrap();
    if let Some(sizes) = graphs {
        model.enable_graphs(sizes).unwrap();
    }
    model
}

/// Request `i`'s pages, handed out in reverse so the block table matters.
fn table(i: usize) -> Vec<u32> {
    (i * PAGES..(i + 1) * PAGES)
        .rev()
        .map(|p| p as u32)
        .collect()
}

/// Token `k` of request `i`'s sequence.
fn token(model: &Model, i: usize, k: usize) -> u32 {
    ((i * 7919 + k * 104_729) % model.config.vocab_size) as u32
}

/// Request `i` holding its first `len` tokens, `new` of them new in this step.
fn slice(model: &Model, i: usize, len: usize, new: usize) -> RequestSlice {
    RequestSlice {
        tokens: (len - new..len).map(|k| token(model, i, k)).collect(),
        kv_len: len,
        block_table: table(i)[..len.div_ceil(PAGE)].to_vec(),
        tree: None,
    }
}

/// Decode step `step` of requests `0..requests` (each one new token after its prefill).
fn decoding(model: &Model, requests: usize, step: usize) -> Vec<RequestSlice> {
    (0..requests)
        .map(|i| slice(model, i, 2 * i + 2 + step, 1))
        .collect()
}

/// `requests` prefilled (eagerly: a prefill is never replayed) with `2i + 1` tokens each.
fn prefilled(model: &Model, requests: usize) -> KvPool {
    let pool = model.kv_pool(requests * PAGES, PAGE, KvFormat::Fp8);
    let batch = (0..requests)
        .map(|i| slice(model, i, 2 * i + 1, 2 * i + 1))
        .collect();
    model.forward(&Batch::new(batch), &pool).unwrap();
    pool
}

/// Four requests of different context lengths decoded together for 20 steps, at a batch
/// size graphs are recorded at: the first step of each block-table width (2, 4 and 8
/// pages as the longest context grows from 8 to 27 tokens) records, the others replay with
/// new ids, positions, slots, KV lengths and block tables written in place. Every logit is
/// the eager step's, bit for bit.
#[test]
fn replayed_decode_steps_compute_the_eager_steps_bits() {
    let logits = |graphs: Option<Vec<usize>>| {
        let model = model(graphs);
        let pool = prefilled(&model, 4);
        let mut bits = Vec::new();
        for step in 0..20 {
            let batch = Batch::last_logits(decoding(&model, 4, step));
            let out = model.forward(&batch, &pool).unwrap();
            bits.extend(out.iter().map(|x| x.to_bits()));
        }
        (bits, model.graph_stats())
    };
    let ((eager, none), (replayed, stats)) = (logits(None), logits(Some(vec![1, 4, 8])));
    assert_eq!(none, None);
    let stats = stats.expect("graphs are on");
    assert_eq!((stats.recorded, stats.replayed), (3, 17), "{stats:?}");
    assert_eq!(stats.held, 3);
    assert!(stats.held_bytes > 0);
    assert_eq!(eager.len(), replayed.len());
    let differ = eager.iter().zip(&replayed).filter(|(a, b)| a != b).count();
    assert_eq!(differ, 0, "{differ} of {} logits differ", eager.len());
}

/// Three requests padded to a graph of four, greedy on the device, each step's input ids
/// taken from the previous step's sampled tokens on the device (the overlapped schedule's
/// `from_previous`): the replayed steps emit the eager steps' tokens.
#[test]
fn padded_replays_emit_the_eager_greedy_tokens() {
    let tokens = |graphs: Option<Vec<usize>>| {
        let model = model(graphs);
        let pool = prefilled(&model, 3);
        let mut emitted = Vec::new();
        let mut previous = None;
        for step in 0..16 {
            let mut batch = Batch::last_logits(decoding(&model, 3, step));
            batch.sampling = Some(vec![SamplingRow::greedy(); 3]);
            if step > 0 {
                batch.from_previous = (0..3).map(|i| (i, i)).collect();
            }
            let launched = model.launch(&batch, &pool, previous.as_ref()).unwrap();
            previous = launched.sampled().cloned();
            let out = launched.wait().unwrap();
            assert_eq!(out.tokens.len(), 3, "the batch's rows only");
            emitted.extend(out.tokens);
        }
        emitted
    };
    assert_eq!(tokens(Some(vec![4])), tokens(None));
}

/// Graphs are refused where they cannot run, and a batch larger than every size runs eagerly.
#[test]
fn graphs_need_the_routed_runtime_and_sizes() {
    let mut cubecl = GpuModel::load(kiln_backends::Cuda::client(), &checkpoint()).unwrap();
    assert!(
        cubecl.enable_graphs(vec![4]).is_err(),
        "CubeCL's own runtime"
    );
    let mut routed = model(None);
    assert!(routed.enable_graphs(vec![]).is_err());
    assert!(routed.enable_graphs(vec![0, 4]).is_err());
    routed.enable_graphs(vec![2]).unwrap();
    let pool = prefilled(&routed, 3);
    let batch = Batch::last_logits(decoding(&routed, 3, 0));
    let out = routed.step(&batch, &pool).unwrap();
    assert_eq!(out.logits.len(), 3 * routed.config.vocab_size);
}
