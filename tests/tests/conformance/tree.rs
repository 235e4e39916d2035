//! Tree verification conformance on every enabled backend: proptest over batch sizes, tree
//! shapes (a single root, chains, bushes, up to 64 nodes) and vocabularies, plus the
//! property that makes stochastic verification lossless, checked on the kernel itself.
use crate::cases::reports_pass;
use cubecl::prelude::*;
use kiln_conformance::tree::{run_tree, TreeCase};
use kiln_kernels::tree_verify::{verify_greedy, verify_stochastic, TreeBatch, Verdicts};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::data::{categorical, Rng};
use kiln_reference::stats::{chi_square, critical_value_p001};
use proptest::prelude::*;

fn cases(stochastic: bool) -> impl Strategy<Value = TreeCase> {
    (1usize..=5, 1usize..=64, 2usize..=300, any::<u64>()).prop_map(
        move |(batch, nodes, vocab, seed)| TreeCase {
            batch,
            nodes,
            vocab,
            stochastic,
            seed,
            cubes: None,
        },
    )
}

fn tree_cases<R: Runtime>(client: &ComputeClient<R>, stochastic: bool) {
    reports_pass(32, &cases(stochastic), |case| run_tree(client, case, false));
}

fn greedy<R: Runtime>(client: &ComputeClient<R>) {
    tree_cases(client, false);
}

fn stochastic<R: Runtime>(client: &ComputeClient<R>) {
    tree_cases(client, true);
}

/// Vocabularies wide enough for every group of a cube to stream its own segment and for
/// the bonus to be found in three levels (segment, unit span, token); one holds no whole
/// 4-float vectors per row.
fn large_vocabularies_match_the_reference<R: Runtime>(client: &ComputeClient<R>) {
    for (vocab, seed) in [(40_000, 5), (9_999, 6)] {
        let case = TreeCase {
            batch: 3,
            nodes: 24,
            vocab,
            stochastic: true,
            seed,
            cubes: None,
        };
        let report = run_tree(client, &case, false).expect("valid case launches");
        assert!(report.passed, "{case:?}: {}", report.detail);
    }
}

/// Rows split over several cubes per request (odd counts, unequal shares, rows with and
/// without whole 4-float vectors) give the reference's verdicts. A device that cannot
/// promise every cube is resident at once (no SM count: wgpu) refuses a split by name.
fn split_rows_match_the_reference<R: Runtime>(client: &ComputeClient<R>) {
    let resident = client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .is_some();
    for (cubes, vocab, seed) in [
        (2, 20_000, 21),
        (3, 30_011, 22),
        (5, 20_000, 23),
        (7, 30_011, 24),
    ] {
        let case = TreeCase {
            batch: 2,
            nodes: 40,
            vocab,
            stochastic: true,
            seed,
            cubes: Some(cubes),
        };
        match run_tree(client, &case, false) {
            Ok(report) => assert!(report.passed, "{case:?}: {}", report.detail),
            Err(KernelError::Range { what, .. }) if !resident => {
                assert_eq!(what, "cubes per request")
            }
            Err(e) => panic!("{case:?}: {e}"),
        }
    }
}

/// 20,000 independent trials in one launch: a root with 3 children drawn i.i.d. from the
/// draft `q`; the first token emitted (accepted child or bonus) must follow the target `p`.
/// Chi-square at p = 0.001 over the tokens `p` gives mass to; tokens without target mass
/// must never appear.
fn stochastic_verification_is_lossless<R: Runtime>(client: &ComputeClient<R>) {
    let cases: [([f32; 5], [f32; 5]); 3] = [
        ([0.1, 0.2, 0.3, 0.25, 0.15], [0.5, 0.5, 0.0, 0.0, 0.0]),
        ([0.05, 0.05, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.05, 0.05]),
        ([0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.35, 0.35]),
    ];
    let (trials, nodes, vocab) = (20_000usize, 4usize, 5usize);
    for (case, (p, q)) in cases.iter().enumerate() {
        let mut rng = Rng::new(77 + case as u64);
        let q64: Vec<f64> = q.iter().map(|&x| x as f64).collect();
        let mut tokens = Vec::with_capacity(trials * nodes);
        for _ in 0..trials {
            tokens.push(0u32);
            tokens.extend((1..nodes).map(|_| categorical(&mut rng, &q64) as u32));
        }
        let parents: Vec<i32> = (0..trials).flat_map(|_| [-1, 0, 0, 0]).collect();
        // Every node carries the same target and draft rows; only the root's matter here.
        let target: Vec<f32> = (0..trials * nodes).flat_map(|_| *p).collect();
        let draft: Vec<f32> = (0..trials * nodes).flat_map(|_| *q).collect();
        let uniforms: Vec<f32> = (0..trials * (nodes + 1))
            .map(|_| rng.uniform_f32())
            .collect();
        let trees = TreeBatch {
            batch: trials,
            nodes,
            parents: DeviceArray::upload(client, &parents),
            tokens: DeviceArray::upload(client, &tokens),
        };
        let out = Verdicts::new(client, trials, nodes);
        verify_stochastic(
            client,
            &trees,
            &DeviceArray::upload(client, &target),
            &DeviceArray::upload(client, &draft),
            &DeviceArray::upload(client, &uniforms),
            vocab,
            &out,
        )
        .unwrap();
        let accepted = out.accepted.read(client);
        let bonus = out.bonus.read(client);
        let mut counts = [0usize; 5];
        for b in 0..trials {
            let first = match accepted[b * nodes] {
                -1 => bonus[b],
                child => tokens[b * nodes + child as usize],
            };
            counts[first as usize] += 1;
        }
        let probs: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let fit = chi_square(&counts, &probs);
        assert_eq!(
            fit.impossible, 0,
            "case {case}: a token without target mass was emitted"
        );
        let critical = critical_value_p001(fit.dof);
        assert!(
            fit.statistic < critical,
            "case {case}: chi2 {:.2} >= {critical:.2} ({counts:?})",
            fit.statistic
        );
    }
}

fn bad_inputs_are_typed_errors<R: Runtime>(client: &ComputeClient<R>) {
    let trees = |nodes: usize| TreeBatch {
        batch: 2,
        nodes,
        parents: DeviceArray::upload(client, &vec![0i32; 2 * nodes]),
        tokens: DeviceArray::upload(client, &vec![1u32; 2 * nodes]),
    };
    let argmax = DeviceArray::upload(client, &[1u32; 6]);
    assert_eq!(
        verify_greedy(client, &trees(3), &argmax, &Verdicts::new(client, 2, 2)).unwrap_err(),
        KernelError::Length {
            what: "accepted",
            expected: 6,
            got: 4
        }
    );
    assert!(matches!(
        verify_greedy(client, &trees(300), &argmax, &Verdicts::new(client, 2, 300)),
        Err(KernelError::Range {
            what: "tree nodes",
            ..
        })
    ));
    let probs = DeviceArray::upload(client, &[0.25f32; 6 * 4]);
    let uniforms = DeviceArray::upload(client, &[0.5f32; 7]);
    assert_eq!(
        verify_stochastic(
            client,
            &trees(3),
            &probs,
            &probs,
            &uniforms,
            4,
            &Verdicts::new(client, 2, 3)
        )
        .unwrap_err(),
        KernelError::Length {
            what: "uniforms",
            expected: 8,
            got: 7
        }
    );
}

kiln_backends::backend_tests! {
    greedy,
    stochastic,
    stochastic_verification_is_lossless,
    large_vocabularies_match_the_reference,
    split_rows_match_the_reference,
    bad_inputs_are_typed_errors,
}
