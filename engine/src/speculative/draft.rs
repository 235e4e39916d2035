//! A draft: a token tree rooted at the request's last token. Node `k` holds `tokens[k]`
//! and follows its parent, `parents[k]`: an earlier node, or [`ROOT`] (the request's last
//! token). A chain is the tree whose node `k` follows node `k - 1`. The scheduler runs the
//! root and the nodes in one step, node `k` at the position of its depth, seeing the
//! context and its ancestors only (a tree mask), and verification walks from the root.

/// The parent of the root's children: the request's last token.
pub const ROOT: i32 = -1;

/// Most nodes in a draft: with its root, a tree fills the attention kernels' 32-query mask
/// window (`kiln_kernels::mla::MAX_TREE_NODES`).
pub const MAX_DRAFT_NODES: usize = kiln_kernels::mla::MAX_TREE_NODES - 1;

/// See the module docs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// `parents[k]` is [`ROOT`] or in `0..k`.
    pub parents: Vec<i32>,
}

impl Draft {
    /// Tokens that follow one another.
    pub fn chain(tokens: Vec<u32>) -> Self {
        let parents = (0..tokens.len() as i32).map(|k| k - 1).collect();
        Draft { tokens, parents }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Whether node `k` follows node `k - 1` throughout.
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .all(|(k, &p)| p == k as i32 - 1)
    }

    /// Keeps the first `n` nodes (still a tree: parents come first).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.parents.truncate(n);
    }

    /// The first `n` nodes.
    pub fn prefix(&self, n: usize) -> Draft {
        let mut d = self.clone();
        d.truncate(n);
        d
    }

    /// Nodes that follow `node` ([`ROOT`] or a node), in index order.
    pub fn children(&self, node: i32) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(move |&k| self.parents[k] == node)
    }

    /// Tokens from the root to node `k`, the root excluded: the node's depth.
    pub fn depth(&self, k: usize) -> usize {
        let (mut depth, mut node) = (1, self.parents[k]);
        while node != ROOT {
            depth += 1;
            node = self.parents[node as usize];
        }
        depth
    }

    /// The deepest node's depth (0 for an empty draft).
    pub fn max_depth(&self) -> usize {
        (0..self.len()).map(|k| self.depth(k)).max().unwrap_or(0)
    }

    /// The tree with its root as node 0: the parents of the step's last `1 + len()`
    /// query tokens, as the attention kernels' masks take them.
    pub fn rooted_parents(&self) -> Vec<i32> {
        std::iter::once(-1)
            .chain(self.parents.iter().map(|&p| p + 1))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_of_a_tree() {
        // root -> 0 -> {1, 3}, root -> 2, 1 -> 4.
        let d = Draft {
            tokens: vec![10, 11, 12, 13, 14],
            parents: vec![ROOT, 0, ROOT, 0, 1],
        };
        assert!(!d.is_chain());
        assert_eq!(d.children(ROOT).collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(d.children(0).collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(
            (0..5).map(|k| d.depth(k)).collect::<Vec<_>>(),
            vec![1, 2, 1, 2, 3]
        );
        assert_eq!(d.max_depth(), 3);
        assert_eq!(d.rooted_parents(), vec![-1, 0, 1, 0, 1, 2]);
        assert_eq!(
            d.prefix(2),
            Draft {
                tokens: vec![10, 11],
                parents: vec![ROOT, 0]
            }
        );
        let c = Draft::chain(vec![5, 6, 7]);
        assert!(c.is_chain());
        assert_eq!(c.max_depth(), 3);
        assert_eq!(Draft::default().max_depth(), 0);
    }
}
