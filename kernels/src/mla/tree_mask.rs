//! Draft-tree masks (speculative decoding): a request's last query tokens may be the
//! nodes of a token tree, each seeing the context before the tree and its own ancestors
//! instead of every earlier position (`kiln_reference::mla`'s `AttnBatch::trees`).
//!
//! Encoding: one `u32` per query token. A request's *window* is its last
//! `min(q_len, 32)` query positions; bit `j` of a token's word says whether the window's
//! `j`-th position is visible to it. Positions before the window are visible as causal
//! attention has them, so a tree of up to [`MAX_TREE_NODES`] nodes fits, preceded by
//! any number of plain (causal) query tokens.
use cubecl::prelude::*;

/// Most nodes of a draft tree.
pub const MAX_TREE_NODES: usize = 32;

/// The mask words of one request's `q_len` query tokens whose last `parents.len()` form
/// a tree (`parents[0] == -1`, `0 <= parents[k] < k`; checked by the caller's tree).
///
/// Panics if the tree has more than [`MAX_TREE_NODES`] nodes or more nodes than queries.
pub fn tree_mask_words(q_len: usize, parents: &[i32]) -> Vec<u32> {
    let n = parents.len();
    assert!(
        n <= MAX_TREE_NODES && n <= q_len,
        "a tree of {n} nodes over {q_len} queries (at most {MAX_TREE_NODES})"
    );
    let window = q_len.min(MAX_TREE_NODES);
    let before = window - n; // plain queries inside the window, before the tree
    let mut words = vec![u32::MAX; q_len];
    for i in 0..window {
        let word = &mut words[q_len - window + i];
        if i < before {
            *word = low_bits(i + 1);
        } else {
            *word = low_bits(before);
            let mut node = (i - before) as i32;
            while node >= 0 {
                *word |= 1 << (before + node as usize);
                node = parents[node as usize];
            }
        }
    }
    words
}

/// A word with the low `n` bits set (`n <= 32`).
fn low_bits(n: usize) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

/// First position of a request's mask window.
#[cube]
pub(super) fn tree_window(kv_len: usize, q_len: usize) -> usize {
    kv_len - min(q_len, comptime!(MAX_TREE_NODES))
}

/// Whether a query at `pos` with mask word `mask` sees key position `key`: causal, and
/// with a tree also inside the mask where the key is in the window.
#[cube]
pub(super) fn sees(
    key: usize,
    pos: usize,
    window: usize,
    mask: u32,
    #[comptime] tree: bool,
) -> bool {
    let mut visible = key <= pos;
    if comptime!(tree) {
        // Keys before the window give a wrapped shift whose bit is never used.
        let in_window = key >= window;
        let shift = select(in_window, (key - window) as u32, 0u32);
        visible = visible && (!in_window || ((mask >> shift) & 1u32) == 1u32);
    }
    visible
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_window_tree_and_a_chain() {
        let chain: Vec<i32> = (-1..31).collect();
        let words = tree_mask_words(32, &chain);
        assert_eq!(words[31], u32::MAX);
        assert_eq!(words[0], 1);
        assert_eq!(tree_mask_words(3, &[-1]), vec![0b1, 0b11, 0b111]);
        // Past 32 queries the first ones are outside the window; a root with two children.
        let words = tree_mask_words(34, &[-1, 0, 0]);
        assert_eq!(&words[..2], &[u32::MAX, u32::MAX]);
        assert_eq!(words[2], 1);
        let plain = (1u32 << 29) - 1;
        assert_eq!(
            &words[31..],
            &[plain | 1 << 29, plain | 3 << 29, plain | 5 << 29]
        );
    }
}
