//! The radix prefix cache (SGLang's RadixAttention, page-granular): a tree over token ids
//! whose edges hold whole pages of tokens and the KV pages that store them.
//!
//! Invariants: every node but the root holds at least one page; a node's `tokens` are
//! exactly `pages.len() * page_size` long; children are keyed by the tokens of their first
//! page, so siblings differ in their first page. Eviction trims least-recently-used leaves
//! from the tail, one page at a time, and only pages no request holds.
use std::collections::{BinaryHeap, HashMap};

use super::{PagePool, PrefixCache};

const ROOT: usize = 0;

#[derive(Debug, Default)]
struct Node {
    tokens: Vec<u32>,
    pages: Vec<u32>,
    children: HashMap<Vec<u32>, usize>,
    parent: usize,
    last_access: u64,
}

/// A page-granular radix tree of cached prefixes.
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    /// Slab of nodes; `None` marks a removed node whose slot is in `vacant`.
    nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    clock: u64,
    pages: usize,
}

impl RadixCache {
    /// An empty tree over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size > 0);
        RadixCache {
            page_size,
            nodes: vec![Some(Node::default())],
            vacant: Vec::new(),
            clock: 0,
            pages: 0,
        }
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    fn add(&mut self, node: Node) -> usize {
        match self.vacant.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// Full pages that `node`'s tokens share with `tokens` (from its start).
    fn common_pages(&self, node: usize, tokens: &[u32]) -> usize {
        let n = self.node(node);
        n.tokens
            .chunks(self.page_size)
            .zip(tokens.chunks_exact(self.page_size))
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Walks from the root along `tokens`: the path of (node, pages matched in it).
    fn walk(&self, tokens: &[u32]) -> Vec<(usize, usize)> {
        let mut path = Vec::new();
        let (mut node, mut pos) = (ROOT, 0);
        while tokens.len() - pos >= self.page_size {
            let key = &tokens[pos..pos + self.page_size];
            let Some(&child) = self.node(node).children.get(key) else {
                break;
            };
            let n = self.common_pages(child, &tokens[pos..]);
            path.push((child, n));
            pos += n * self.page_size;
            if n < self.node(child).pages.len() {
                break;
            }
            node = child;
        }
        path
    }

    fn touch(&mut self, path: &[(usize, usize)]) {
        self.clock += 1;
        for &(id, _) in path {
            let clock = self.clock;
            self.node_mut(id).last_access = clock;
        }
    }

    /// Splits `id` after its first `n` pages; returns the new upper node.
    fn split(&mut self, id: usize, n: usize) -> usize {
        let cut = n * self.page_size;
        let (parent, upper_tokens, upper_pages, last_access) = {
            let node = self.node_mut(id);
            let tokens: Vec<u32> = node.tokens.drain(..cut).collect();
            let pages: Vec<u32> = node.pages.drain(..n).collect();
            (node.parent, tokens, pages, node.last_access)
        };
        let key = upper_tokens[..self.page_size].to_vec();
        let lower_key = self.node(id).tokens[..self.page_size].to_vec();
        let upper = self.add(Node {
            tokens: upper_tokens,
            pages: upper_pages,
            children: HashMap::from([(lower_key, id)]),
            parent,
            last_access,
        });
        self.node_mut(id).parent = upper;
        self.node_mut(parent).children.insert(key, upper);
        upper
    }

    fn remove_leaf(&mut self, id: usize) {
        let node = self.nodes[id].take().expect("live node");
        debug_assert!(node.children.is_empty() && node.pages.is_empty());
        let parent = self.node_mut(node.parent);
        parent.children.retain(|_, &mut c| c != id);
        self.vacant.push(id);
    }
}

impl PrefixCache for RadixCache {
    fn lookup(&mut self, tokens: &[u32]) -> Vec<u32> {
        let path = self.walk(tokens);
        self.touch(&path);
        path.iter()
            .flat_map(|&(id, n)| self.node(id).pages[..n].iter().copied())
            .collect()
    }

    fn insert(&mut self, tokens: &[u32], pages: &[u32], pool: &mut PagePool) -> Vec<u32> {
        assert_eq!(tokens.len(), pages.len() * self.page_size);
        let mut path = Vec::new();
        let (mut node, mut done) = (ROOT, 0);
        while done < pages.len() {
            let pos = done * self.page_size;
            let key = &tokens[pos..pos + self.page_size];
            let Some(&child) = self.node(node).children.get(key) else {
                for &p in &pages[done..] {
                    pool.hold(p);
                }
                self.pages += pages.len() - done;
                let leaf = self.add(Node {
                    tokens: tokens[pos..].to_vec(),
                    pages: pages[done..].to_vec(),
                    children: HashMap::new(),
                    parent: node,
                    last_access: 0,
                });
                self.node_mut(node).children.insert(key.to_vec(), leaf);
                path.push((leaf, pages.len() - done));
                break;
            };
            let n = self.common_pages(child, &tokens[pos..]);
            let next = if n < self.node(child).pages.len() {
                self.split(child, n)
            } else {
                child
            };
            path.push((next, n));
            done += n;
            node = next;
        }
        self.touch(&path);
        path.iter()
            .flat_map(|&(id, n)| self.node(id).pages[..n].iter().copied())
            .collect()
    }

    fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize {
        let mut leaves: BinaryHeap<(std::cmp::Reverse<u64>, usize)> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|(id, n)| *id != ROOT && n.children.is_empty())
            .map(|(id, n)| (std::cmp::Reverse(n.last_access), id))
            .collect();
        let (mut freed, page_size) = (0, self.page_size);
        while freed < want {
            let Some((_, id)) = leaves.pop() else { break };
            let node = self.node_mut(id);
            while freed < want {
                match node.pages.last() {
                    Some(&p) if pool.is_cache_only(p) => {
                        node.pages.pop();
                        pool.unhold(p);
                        freed += 1;
                    }
                    _ => break,
                }
            }
            let keep = node.pages.len() * page_size;
            node.tokens.truncate(keep);
            let (emptied, parent) = (node.pages.is_empty(), node.parent);
            if emptied {
                self.remove_leaf(id);
                let p = self.node(parent);
                if parent != ROOT && p.children.is_empty() {
                    leaves.push((std::cmp::Reverse(p.last_access), parent));
                }
            }
        }
        self.pages -= freed;
        freed
    }

    fn cached_pages(&self) -> usize {
        self.pages
    }
}
