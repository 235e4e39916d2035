//! Speculative-decoding token trees: attention masks and verification (greedy and
//! lossless stochastic).
//!
//! A tree holds draft tokens; node 0 is the root (the last committed token) and every
//! other node's parent has a smaller index, so index order is a topological order.
//! The target model scores all nodes in one forward pass with [`tree_mask`] (each node
//! sees itself and its ancestors); verification then walks from the root, accepting
//! children, and ends with one "bonus" token sampled from the target, so every step
//! emits `accepted.len() + 1` tokens.
//!
//! Stochastic verification is SpecInfer's multi-step speculative sampling (Miao et
//! al., "SpecInfer", ASPLOS 2024, Alg. 2), lossless when a node's children were drawn
//! i.i.d. from the draft's distribution at that node: with residual `r` (initially the
//! target `p`) and draft `q`, a child `x` is accepted with probability
//! `min(1, r(x) / q(x))`; on rejection `r <- norm(relu(r - q))`. One step emits `x`
//! with probability `min(q(x), r(x))` and rejects with probability
//! `sum relu(r - q)`, after which the rest emits `relu(r - q) / sum` by induction; the
//! total is `min(q, r) + relu(r - q) = r`. The first token emitted from a node is
//! therefore distributed exactly as the target's distribution there.

use std::fmt;

/// A draft token tree.
#[derive(Debug, Clone, PartialEq)]
pub struct Tree {
    /// Parent of each node; `parents[0] == -1`, `0 <= parents[i] < i` otherwise.
    pub parents: Vec<i32>,
    /// Token of each node (node 0: the last committed token).
    pub tokens: Vec<u32>,
}

/// A malformed tree.
#[derive(Debug, Clone, PartialEq)]
pub enum TreeError {
    /// The tree has no root.
    Empty,
    /// `parents` and `tokens` differ in length.
    LengthMismatch { parents: usize, tokens: usize },
    /// Node 0 has a parent (it must be -1).
    RootHasParent { parent: i32 },
    /// A non-root node's parent is not an earlier node.
    BadParent { node: usize, parent: i32 },
}

impl fmt::Display for TreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "tree has no nodes"),
            Self::LengthMismatch { parents, tokens } => {
                write!(f, "{parents} parents but {tokens} tokens")
            }
            Self::RootHasParent { parent } => write!(f, "root has parent {parent}, expected -1"),
            Self::BadParent { node, parent } => {
                write!(f, "node {node} has parent {parent}, expected 0..{node}")
            }
        }
    }
}

impl std::error::Error for TreeError {}

impl Tree {
    /// Number of nodes, root included.
    pub fn len(&self) -> usize {
        self.parents.len()
    }

    /// Whether the tree has no nodes (never true for a valid tree).
    pub fn is_empty(&self) -> bool {
        self.parents.is_empty()
    }

    /// Checks the root and parent-order invariants.
    pub fn validate(&self) -> Result<(), TreeError> {
        if self.parents.len() != self.tokens.len() {
            return Err(TreeError::LengthMismatch {
                parents: self.parents.len(),
                tokens: self.tokens.len(),
            });
        }
        match self.parents.first() {
            None => return Err(TreeError::Empty),
            Some(&parent) if parent != -1 => return Err(TreeError::RootHasParent { parent }),
            _ => {}
        }
        for (node, &parent) in self.parents.iter().enumerate().skip(1) {
            if parent < 0 || parent as usize >= node {
                return Err(TreeError::BadParent { node, parent });
            }
        }
        Ok(())
    }

    /// Children of `node`, in ascending index order.
    pub fn children(&self, node: usize) -> impl Iterator<Item = usize> + '_ {
        (node + 1..self.len()).filter(move |&c| self.parents[c] == node as i32)
    }

    /// Number of edges from the root to `node`.
    pub fn depth(&self, node: usize) -> usize {
        let mut depth = 0;
        let mut cur = node;
        while self.parents[cur] >= 0 {
            cur = self.parents[cur] as usize;
            depth += 1;
        }
        depth
    }
}

/// The `n * n` tree attention mask: `mask[i * n + j]` is true iff `j` is `i` or an
/// ancestor of `i`.
pub fn tree_mask(parents: &[i32]) -> Vec<bool> {
    let n = parents.len();
    let mut mask = vec![false; n * n];
    for i in 0..n {
        let mut j = i as i32;
        while j >= 0 {
            mask[i * n + j as usize] = true;
            j = parents[j as usize];
        }
    }
    mask
}

/// Outcome of verifying one tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Accepted nodes, root excluded, from the root's child downwards.
    pub accepted: Vec<usize>,
    /// Token sampled from the target after the last accepted node.
    pub bonus: u32,
}

fn check_tree(tree: &Tree) {
    if let Err(e) = tree.validate() {
        panic!("invalid tree: {e}");
    }
}

/// Greedy verification: from the root, repeatedly move to the lowest-index child
/// whose token equals the target's argmax at the current node; the bonus is the
/// argmax at the last node reached. `target_argmax` has one entry per node.
///
/// Panics if the tree is invalid or `target_argmax` has the wrong length.
pub fn verify_greedy(tree: &Tree, target_argmax: &[u32]) -> Verdict {
    check_tree(tree);
    assert_eq!(target_argmax.len(), tree.len(), "one argmax per node");
    let mut cur = 0;
    let mut accepted = Vec::new();
    while let Some(c) = tree
        .children(cur)
        .find(|&c| tree.tokens[c] == target_argmax[cur])
    {
        accepted.push(c);
        cur = c;
    }
    Verdict {
        accepted,
        bonus: target_argmax[cur],
    }
}

/// Stochastic (lossless) verification, SpecInfer's multi-step speculative sampling.
///
/// `target_probs` and `draft_probs` are `[n, vocab]`: row `i` is the target's /
/// draft's next-token distribution after node `i` (the children of `i` were drawn
/// i.i.d. from draft row `i`). `uniforms` has `n + 1` values in `[0, 1)`:
/// `uniforms[c]` decides child `c`, `uniforms[n]` samples the bonus token.
///
/// Child `x` of the current node is accepted iff `u * q(x) < r(x)`. On rejection
/// `r <- relu(r - q)` renormalized. If that sum is zero, `r <= q` everywhere and both
/// sum to one, so `r == q`: then every child with `q(x) > 0` is accepted (`u q < q`),
/// and the rejection came from rounding or a child with `q(x) = 0`; `r` is kept as it
/// was, which is the exact residual's limit (the relu-renormalization is undefined).
///
/// Panics if the tree is invalid or a slice has the wrong length.
pub fn verify_stochastic(
    tree: &Tree,
    target_probs: &[f32],
    draft_probs: &[f32],
    uniforms: &[f32],
    vocab: usize,
) -> Verdict {
    check_tree(tree);
    let n = tree.len();
    assert_eq!(
        target_probs.len(),
        n * vocab,
        "target_probs is not [{n}, {vocab}]"
    );
    assert_eq!(
        draft_probs.len(),
        n * vocab,
        "draft_probs is not [{n}, {vocab}]"
    );
    assert_eq!(
        uniforms.len(),
        n + 1,
        "uniforms needs n + 1 = {} values",
        n + 1
    );
    let row = |probs: &[f32], i: usize| -> Vec<f64> {
        probs[i * vocab..(i + 1) * vocab]
            .iter()
            .map(|&p| p as f64)
            .collect()
    };
    let mut cur = 0;
    let mut accepted = Vec::new();
    let mut r = row(target_probs, 0);
    'walk: loop {
        let q = row(draft_probs, cur);
        for c in tree.children(cur) {
            let x = tree.tokens[c] as usize;
            if (uniforms[c] as f64) * q[x] < r[x] {
                accepted.push(c);
                cur = c;
                r = row(target_probs, c);
                continue 'walk;
            }
            r = residual(&r, &q);
        }
        break;
    }
    Verdict {
        accepted,
        bonus: sample_bonus(&r, uniforms[n] as f64),
    }
}

/// `relu(r - q)` normalized to sum 1, or `r` unchanged when that sum is zero.
fn residual(r: &[f64], q: &[f64]) -> Vec<f64> {
    let diff: Vec<f64> = r.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let sum: f64 = diff.iter().sum();
    if sum > 0.0 {
        diff.into_iter().map(|d| d / sum).collect()
    } else {
        r.to_vec()
    }
}

/// Smallest token `t` with `cumsum(r)[t] > u * sum(r)`; if rounding leaves none, the
/// last token with `r > 0`.
fn sample_bonus(r: &[f64], u: f64) -> u32 {
    let target = u * r.iter().sum::<f64>();
    let mut acc = 0.0;
    for (t, &p) in r.iter().enumerate() {
        acc += p;
        if acc > target {
            return t as u32;
        }
    }
    r.iter().rposition(|&p| p > 0.0).unwrap_or(r.len() - 1) as u32
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
