//! Tree invariants, greedy verification, and a statistical test that stochastic
//! verification is lossless.

use super::*;
use crate::data::{categorical, random_distribution, Rng};
use crate::stats::{chi_square, critical_value_p001};

/// Root 0 with children 1, 2; node 1 has children 3, 4; node 2 has child 5.
fn sample_tree() -> Tree {
    Tree {
        parents: vec![-1, 0, 0, 1, 1, 2],
        tokens: vec![100, 7, 8, 9, 7, 9],
    }
}

#[test]
fn validate_reports_each_problem() {
    assert_eq!(sample_tree().validate(), Ok(()));
    let empty = Tree {
        parents: vec![],
        tokens: vec![],
    };
    assert_eq!(empty.validate(), Err(TreeError::Empty));
    let t = Tree {
        parents: vec![-1, 0],
        tokens: vec![1],
    };
    assert_eq!(
        t.validate(),
        Err(TreeError::LengthMismatch {
            parents: 2,
            tokens: 1
        })
    );
    let t = Tree {
        parents: vec![0],
        tokens: vec![1],
    };
    assert_eq!(t.validate(), Err(TreeError::RootHasParent { parent: 0 }));
    let t = Tree {
        parents: vec![-1, 0, 2],
        tokens: vec![1, 2, 3],
    };
    assert_eq!(
        t.validate(),
        Err(TreeError::BadParent { node: 2, parent: 2 })
    );
}

#[test]
fn children_depth_and_mask_follow_the_parents() {
    let t = sample_tree();
    assert_eq!(t.children(0).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(t.children(1).collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(t.children(3).count(), 0);
    assert_eq!(
        (0..6).map(|i| t.depth(i)).collect::<Vec<_>>(),
        vec![0, 1, 1, 2, 2, 2]
    );
    let mask = tree_mask(&t.parents);
    let row = |i: usize| (0..6).filter(|&j| mask[i * 6 + j]).collect::<Vec<_>>();
    assert_eq!(row(0), vec![0]);
    assert_eq!(row(4), vec![0, 1, 4]);
    assert_eq!(row(5), vec![0, 2, 5]);
}

#[test]
fn greedy_follows_the_argmax_chain() {
    let t = sample_tree();
    // argmax at root = 7 (node 1), at node 1 = 7 (node 4), at node 4 = 42 (bonus).
    let v = verify_greedy(&t, &[7, 7, 0, 0, 42, 0]);
    assert_eq!(
        v,
        Verdict {
            accepted: vec![1, 4],
            bonus: 42
        }
    );
    // Nothing matches at the root: the bonus is the root's argmax.
    assert_eq!(
        verify_greedy(&t, &[3, 0, 0, 0, 0, 0]),
        Verdict {
            accepted: vec![],
            bonus: 3
        }
    );
}

#[test]
fn greedy_takes_the_lowest_index_child_among_equal_tokens() {
    let t = Tree {
        parents: vec![-1, 0, 0],
        tokens: vec![0, 5, 5],
    };
    assert_eq!(verify_greedy(&t, &[5, 1, 2]).accepted, vec![1]);
}

#[test]
fn greedy_and_stochastic_agree_on_one_hot_targets() {
    let mut rng = Rng::new(21);
    let vocab = 6;
    for _ in 0..500 {
        let n = 1 + rng.below(8);
        let parents: Vec<i32> = (0..n)
            .map(|i| if i == 0 { -1 } else { rng.below(i) as i32 })
            .collect();
        let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let tree = Tree { parents, tokens };
        let argmax: Vec<u32> = (0..n).map(|_| rng.below(vocab) as u32).collect();
        let mut target = vec![0.0f32; n * vocab];
        for (i, &a) in argmax.iter().enumerate() {
            target[i * vocab + a as usize] = 1.0;
        }
        let draft: Vec<f32> = (0..n)
            .flat_map(|_| random_distribution(&mut rng, vocab, 0.3))
            .collect();
        let uniforms: Vec<f32> = (0..=n).map(|_| rng.uniform_f32()).collect();
        let s = verify_stochastic(&tree, &target, &draft, &uniforms, vocab);
        assert_eq!(s, verify_greedy(&tree, &argmax));
    }
}

#[test]
fn tokens_with_zero_target_probability_are_never_emitted() {
    let mut rng = Rng::new(8);
    let p = [0.5f32, 0.5, 0.0, 0.0];
    let q = [0.0f32, 0.1, 0.45, 0.45];
    for _ in 0..2000 {
        let (first, _) = one_trial(&mut rng, &p, &q, 3);
        assert!(first < 2, "emitted token {first}");
    }
}

/// Builds a root with `children` i.i.d. children drawn from `q`, random rows for the
/// children, and returns the first emitted token and the verdict.
fn one_trial(rng: &mut Rng, p: &[f32], q: &[f32], children: usize) -> (u32, Verdict) {
    let vocab = p.len();
    let n = children + 1;
    let q64: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    let mut tokens = vec![0u32];
    tokens.extend((0..children).map(|_| categorical(rng, &q64) as u32));
    let tree = Tree {
        parents: (0..n as i32).map(|i| if i == 0 { -1 } else { 0 }).collect(),
        tokens,
    };
    let mut target = p.to_vec();
    let mut draft = q.to_vec();
    for _ in 1..n {
        target.extend(random_distribution(rng, vocab, 0.2));
        draft.extend(random_distribution(rng, vocab, 0.2));
    }
    let uniforms: Vec<f32> = (0..=n).map(|_| rng.uniform_f32()).collect();
    let v = verify_stochastic(&tree, &target, &draft, &uniforms, vocab);
    let first = v.accepted.first().map_or(v.bonus, |&c| tree.tokens[c]);
    (first, v)
}

#[test]
fn first_emitted_token_is_distributed_as_the_target() {
    let cases: [([f32; 5], [f32; 5]); 6] = [
        ([0.1, 0.2, 0.3, 0.25, 0.15], [0.2; 5]),
        // The draft never proposes tokens 2..5 that the target wants.
        ([0.1, 0.2, 0.3, 0.25, 0.15], [0.5, 0.5, 0.0, 0.0, 0.0]),
        ([0.05, 0.05, 0.1, 0.1, 0.7], [0.7, 0.1, 0.1, 0.05, 0.05]),
        // p == q: every child is accepted; exercises the zero-residual guard.
        ([0.3, 0.1, 0.2, 0.2, 0.2], [0.3, 0.1, 0.2, 0.2, 0.2]),
        ([0.2; 5], [0.0, 0.0, 0.0, 0.0, 1.0]),
        // Target without support on two tokens (chi-square over the other three).
        ([0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.1, 0.1, 0.35, 0.35]),
    ];
    let trials = 20_000;
    for (case, (p, q)) in cases.iter().enumerate() {
        let mut rng = Rng::new(1000 + case as u64);
        let mut counts = [0usize; 5];
        for _ in 0..trials {
            counts[one_trial(&mut rng, p, q, 3).0 as usize] += 1;
        }
        let probs: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let fit = chi_square(&counts, &probs);
        assert_eq!(
            fit.impossible, 0,
            "case {case}: zero-probability token emitted"
        );
        let critical = critical_value_p001(fit.dof);
        assert!(
            fit.statistic < critical,
            "case {case}: chi2 {:.2} >= {critical} ({counts:?})",
            fit.statistic
        );
    }
}
