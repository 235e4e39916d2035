//! Tree verification cases (greedy and stochastic) against `kiln_reference::tree`.
//!
//! Random trees (`parents[i]` uniform below `i`). Greedy: draft tokens copy the target's
//! argmax at their parent with probability 0.7, so paths of several nodes are accepted.
//! Stochastic: per-node target and draft distributions with zeros, children drawn from their
//! parent's draft row, uniforms shared with the reference. Verdicts must agree exactly.
use cubecl::prelude::*;
use kiln_kernels::tree_verify::{self, TreeBatch, Verdicts};
use kiln_kernels::{DeviceArray, KernelError};
use kiln_reference::data::{categorical, random_distribution, Rng};
use kiln_reference::tree::{verify_greedy, verify_stochastic, Tree, Verdict};

use crate::report::time_launch;
use crate::CaseReport;

/// One verification problem.
#[derive(Clone, Debug)]
pub struct TreeCase {
    pub batch: usize,
    pub nodes: usize,
    pub vocab: usize,
    pub stochastic: bool,
    pub seed: u64,
    /// Cubes per request for the stochastic verifier (`None`: the launcher's choice).
    pub cubes: Option<usize>,
}

struct Inputs {
    trees: Vec<Tree>,
    argmax: Vec<u32>,
    target: Vec<f32>,
    draft: Vec<f32>,
    uniforms: Vec<f32>,
}

fn random_parents(rng: &mut Rng, nodes: usize) -> Vec<i32> {
    std::iter::once(-1)
        .chain((1..nodes).map(|i| rng.below(i) as i32))
        .collect()
}

fn generate(case: &TreeCase) -> Inputs {
    let mut rng = Rng::new(case.seed);
    let (n, v) = (case.nodes, case.vocab);
    let mut inputs = Inputs {
        trees: Vec::new(),
        argmax: Vec::new(),
        target: Vec::new(),
        draft: Vec::new(),
        uniforms: Vec::new(),
    };
    for _ in 0..case.batch {
        let parents = random_parents(&mut rng, n);
        let mut tokens = vec![rng.below(v) as u32];
        if case.stochastic {
            let target: Vec<f32> = (0..n)
                .flat_map(|_| random_distribution(&mut rng, v, 0.3))
                .collect();
            let draft: Vec<f32> = (0..n)
                .flat_map(|_| random_distribution(&mut rng, v, 0.3))
                .collect();
            for &p in &parents[1..] {
                let row: Vec<f64> = draft[p as usize * v..(p as usize + 1) * v]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                tokens.push(categorical(&mut rng, &row) as u32);
            }
            inputs.target.extend(target);
            inputs.draft.extend(draft);
            inputs.uniforms.extend((0..=n).map(|_| rng.uniform_f32()));
        } else {
            let argmax: Vec<u32> = (0..n).map(|_| rng.below(v) as u32).collect();
            for &p in &parents[1..] {
                let copy = rng.uniform() < 0.7;
                tokens.push(if copy {
                    argmax[p as usize]
                } else {
                    rng.below(v) as u32
                });
            }
            inputs.argmax.extend(argmax);
        }
        inputs.trees.push(Tree { parents, tokens });
    }
    inputs
}

/// Runs the case on the device and against the reference.
pub fn run_tree<R: Runtime>(
    client: &ComputeClient<R>,
    case: &TreeCase,
    timing: bool,
) -> Result<CaseReport, KernelError> {
    let inputs = generate(case);
    let (n, v) = (case.nodes, case.vocab);
    let parents: Vec<i32> = inputs
        .trees
        .iter()
        .flat_map(|t| t.parents.clone())
        .collect();
    let tokens: Vec<u32> = inputs.trees.iter().flat_map(|t| t.tokens.clone()).collect();
    let trees = TreeBatch {
        batch: case.batch,
        nodes: n,
        parents: DeviceArray::upload(client, &parents),
        tokens: DeviceArray::upload(client, &tokens),
    };
    let out = Verdicts::new(client, case.batch, n);
    let (argmax, target, draft, uniforms);
    let cubes = case
        .cubes
        .unwrap_or_else(|| tree_verify::stochastic_split(client, case.batch, v));
    let launch: Box<dyn Fn() -> Result<(), KernelError>> = if case.stochastic {
        target = DeviceArray::upload(client, &inputs.target);
        draft = DeviceArray::upload(client, &inputs.draft);
        uniforms = DeviceArray::upload(client, &inputs.uniforms);
        Box::new(|| {
            tree_verify::verify_stochastic_split(
                client, &trees, &target, &draft, &uniforms, v, &out, cubes,
            )
        })
    } else {
        argmax = DeviceArray::upload(client, &inputs.argmax);
        Box::new(|| tree_verify::verify_greedy(client, &trees, &argmax, &out))
    };
    // Twice over the same buffers: the stochastic verifier's cubes must leave their
    // exchange words as they found them.
    launch()?;
    launch()?;
    let accepted = out.accepted.read(client);
    let accept_len = out.accept_len.read(client);
    let bonus = out.bonus.read(client);

    let mut mismatches = Vec::new();
    for (b, tree) in inputs.trees.iter().enumerate() {
        let expected: Verdict = if case.stochastic {
            let rows = b * n * v..(b + 1) * n * v;
            let u = &inputs.uniforms[b * (n + 1)..(b + 1) * (n + 1)];
            verify_stochastic(
                tree,
                &inputs.target[rows.clone()],
                &inputs.draft[rows],
                u,
                v,
            )
        } else {
            verify_greedy(tree, &inputs.argmax[b * n..(b + 1) * n])
        };
        let mut want: Vec<i32> = expected.accepted.iter().map(|&i| i as i32).collect();
        want.resize(n, -1);
        let got = &accepted[b * n..(b + 1) * n];
        if got != want.as_slice()
            || accept_len[b] as usize != expected.accepted.len()
            || bonus[b] != expected.bonus
        {
            mismatches.push(format!(
                "request {b}: got path {:?} len {} bonus {}, expected {:?} bonus {}",
                &got[..got.iter().position(|&x| x < 0).unwrap_or(n)],
                accept_len[b],
                bonus[b],
                expected.accepted,
                expected.bonus
            ));
        }
    }
    let mean_accept = accept_len.iter().map(|&l| l as f64).sum::<f64>() / case.batch.max(1) as f64;
    let report = CaseReport {
        kernel: if case.stochastic {
            "verify_stochastic"
        } else {
            "verify_greedy"
        }
        .into(),
        shape: format!("B={} nodes={} vocab={}", case.batch, n, v),
        dtype: if case.stochastic {
            "f32 probs"
        } else {
            "token ids"
        }
        .into(),
        max_abs_err: mismatches.len() as f64,
        max_rel_err: 0.0,
        tolerance: format!("exact (mean accept {mean_accept:.2})"),
        passed: mismatches.is_empty(),
        detail: mismatches
            .into_iter()
            .take(3)
            .collect::<Vec<_>>()
            .join("; "),
        time_us: time_launch(client, timing, || launch().expect("validated above")),
    };
    Ok(report)
}
