//! The tensor-core kernels compile for the GPUs kiln targets, on any machine (NVRTC, see
//! [`Nvrtc`]): the per-head MLA prefill attention (`mma.sync`, `ldmatrix`, `cp.async`) for
//! Hopper (`sm_90a`, what the H200 runs) and Blackwell (`sm_100a`, datacenter; `sm_120a`,
//! workstation), at Kimi's head dims and the smallest the kernel takes, for the first and
//! a middle chunk of a context; and SwiGLU's activation and the random fill, which kiln's
//! own launcher loads (`launcher.rs`). Compiling is what this proves; the H200 runs them.
use kiln_kernels::activation::silu_mul_source;
use kiln_kernels::fill::fill_source;
use kiln_kernels::mla::{heads_attention_source, KvBShape};

use crate::nvrtc::Nvrtc;

const TARGETS: [&str; 3] = ["sm_90a", "sm_100a", "sm_120a"];

#[test]
fn per_head_prefill_attention_compiles_for_hopper_and_blackwell() {
    let nvrtc = Nvrtc::get().unwrap_or_else(|why| panic!("{why}"));
    let kimi = KvBShape {
        heads: 64,
        nope: 128,
        v: 128,
    };
    let smallest = KvBShape {
        heads: 1,
        nope: 32,
        v: 16,
    };
    for shape in [kimi, smallest] {
        for (from_state, keep_state) in [(false, false), (true, true)] {
            let source = heads_attention_source(shape, from_state, keep_state)
                .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
            for op in ["mma.sync.aligned.m16n8k16", "ldmatrix", "cp.async"] {
                assert!(source.contains(op), "{shape:?}: no {op} in:\n{source}");
            }
            for arch in TARGETS {
                match nvrtc.cubin(&source, arch) {
                    Ok(bytes) => {
                        println!("{shape:?} {from_state}/{keep_state} {arch}: {bytes} bytes")
                    }
                    Err(log) => panic!("{shape:?}, {arch}: NVRTC rejected it:\n{log}\n{source}"),
                }
            }
        }
    }
}

#[test]
fn the_launchers_kernels_compile_for_hopper_and_blackwell() {
    let nvrtc = Nvrtc::get().unwrap_or_else(|why| panic!("{why}"));
    for source in [silu_mul_source(), fill_source()] {
        let source = source.expect("CUDA source");
        assert!(
            source.text.contains(&format!("{} (", source.entry)),
            "{}",
            source.text
        );
        for arch in TARGETS {
            if let Err(log) = nvrtc.cubin(&source.text, arch) {
                panic!("{arch}: NVRTC rejected it:\n{log}\n{}", source.text);
            }
        }
    }
}
