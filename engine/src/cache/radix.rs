//! The radix prefix cache (SGLang's RadixAttention, page-granular, with HiCache's host
//! tier): a tree over token ids whose edges hold whole pages of tokens and where each
//! page's KV is: a device page, a host slot, or both.
//!
//! Invariants: every node but the root holds at least one page, and every page has a
//! device page or a host slot; a node's `tokens` are exactly `pages.len() * page_size`
//! long; children are keyed by the tokens of their first page, so siblings differ in their
//! first page. Along every path from the root the device pages come first ("device
//! prefixes are closed"): a hit is some device pages then some host-only ones. Eviction
//! takes the least recently used node whose device pages end the device prefix of every
//! path through it, and demotes them from the tail, only pages no request holds; the host
//! tier, when full, drops the host copies of pages that are also on the device, then the
//! least recently used host-only pages at the ends of leaves. Without a host tier eviction
//! forgets pages instead, from the tails of least recently used leaves.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::{Hit, KvCopy, PagePool, PrefixCache};

const ROOT: usize = 0;

/// Where one cached page's KV is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Page {
    device: Option<u32>,
    host: Option<u32>,
}

#[derive(Debug, Default)]
struct Node {
    tokens: Vec<u32>,
    pages: Vec<Page>,
    children: HashMap<Vec<u32>, usize>,
    parent: usize,
    last_access: u64,
}

impl Node {
    /// Pages on the device: always the first ones.
    fn device_len(&self) -> usize {
        self.pages.iter().take_while(|p| p.device.is_some()).count()
    }

    /// Whether the last page is only in the host tier.
    fn ends_host_only(&self) -> bool {
        self.pages.last().is_some_and(|p| p.device.is_none())
    }
}

/// Host slots: `capacity` of them, handed out in order until all are in use; after that a
/// slot is reused only by dropping the page that held it.
#[derive(Debug)]
struct HostSlots {
    capacity: usize,
    used: usize,
}

impl HostSlots {
    fn take(&mut self) -> Option<u32> {
        (self.used < self.capacity).then(|| {
            self.used += 1;
            (self.used - 1) as u32
        })
    }
}

/// A page-granular radix tree of cached prefixes.
#[derive(Debug)]
pub struct RadixCache {
    page_size: usize,
    /// Slab of nodes; `None` marks a removed node whose slot is in `vacant`.
    nodes: Vec<Option<Node>>,
    vacant: Vec<usize>,
    clock: u64,
    /// Device pages held.
    pages: usize,
    host: HostSlots,
    /// Pages both on the device and in a host slot.
    both: usize,
    copies: Vec<KvCopy>,
}

impl RadixCache {
    /// An empty tree over pages of `page_size` tokens, with no host tier.
    pub fn new(page_size: usize) -> Self {
        Self::with_host_tier(page_size, 0)
    }

    /// An empty tree over pages of `page_size` tokens with `host_slots` pages of host tier.
    pub fn with_host_tier(page_size: usize, host_slots: usize) -> Self {
        assert!(page_size > 0);
        RadixCache {
            page_size,
            nodes: vec![Some(Node::default())],
            vacant: Vec::new(),
            clock: 0,
            pages: 0,
            host: HostSlots {
                capacity: host_slots,
                used: 0,
            },
            both: 0,
            copies: Vec::new(),
        }
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    fn live(&self) -> impl Iterator<Item = (usize, &Node)> {
        (self.nodes.iter().enumerate())
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|&(id, _)| id != ROOT)
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
        super::common_pages(&self.node(node).tokens, tokens, self.page_size)
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

    /// The pages of a walked path, in order.
    fn path_pages<'a>(&'a self, path: &'a [(usize, usize)]) -> impl Iterator<Item = Page> + 'a {
        path.iter()
            .flat_map(|&(id, n)| self.node(id).pages[..n].iter().copied())
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
            let pages: Vec<Page> = node.pages.drain(..n).collect();
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

    /// Removes `id` if it has neither pages nor children; returns its parent if so.
    fn remove_if_empty(&mut self, id: usize) -> Option<usize> {
        let n = self.node(id);
        if !n.pages.is_empty() || !n.children.is_empty() {
            return None;
        }
        let node = self.nodes[id].take().expect("live node");
        let parent = self.node_mut(node.parent);
        parent.children.retain(|_, &mut c| c != id);
        self.vacant.push(id);
        Some(node.parent)
    }

    /// Whether `id`'s device pages end the device prefix of every path through it: it has
    /// some, and no child's first page is on the device.
    fn is_device_frontier(&self, id: usize) -> bool {
        let n = self.node(id);
        id != ROOT
            && n.device_len() > 0
            && (n.children.values()).all(|&c| self.node(c).pages[0].device.is_none())
    }

    /// A free host slot, making room if the tier is full: first by dropping the host copy
    /// of a page that is on the device too, then the least recently used host-only page at
    /// the end of a leaf (`host_leaves`, a heap the caller keeps).
    fn host_slot(&mut self, host_leaves: &mut BinaryHeap<(Reverse<u64>, usize)>) -> Option<u32> {
        if self.host.capacity == 0 {
            return None;
        }
        if let Some(slot) = self.host.take() {
            return Some(slot);
        }
        if self.both > 0 {
            let (id, i) = (self.live())
                .find_map(|(id, n)| {
                    let i = n
                        .pages
                        .iter()
                        .position(|p| p.device.is_some() && p.host.is_some());
                    i.map(|i| (id, i))
                })
                .expect("a page on both tiers");
            let slot = self.node_mut(id).pages[i].host.take().expect("on the host");
            self.both -= 1;
            return Some(slot);
        }
        while let Some((_, id)) = host_leaves.pop() {
            let live = self.nodes[id].as_ref();
            if !live.is_some_and(|n| n.children.is_empty() && n.ends_host_only()) {
                continue; // stale: removed, or no longer a host-only leaf
            }
            let page = self.node_mut(id).pages.pop().expect("a last page");
            let keep = self.node(id).pages.len() * self.page_size;
            self.node_mut(id).tokens.truncate(keep);
            if self.node(id).ends_host_only() {
                host_leaves.push((Reverse(self.node(id).last_access), id));
            } else if let Some(parent) = self.remove_if_empty(id) {
                let p = self.node(parent);
                if parent != ROOT && p.children.is_empty() && p.ends_host_only() {
                    host_leaves.push((Reverse(p.last_access), parent));
                }
            }
            return page.host;
        }
        None
    }
}

impl PrefixCache for RadixCache {
    fn lookup(&mut self, tokens: &[u32]) -> Hit {
        let path = self.walk(tokens);
        self.touch(&path);
        let pages: Vec<Page> = self.path_pages(&path).collect();
        let device: Vec<u32> = pages.iter().map_while(|p| p.device).collect();
        Hit {
            host: pages.len() - device.len(),
            device,
        }
    }

    fn promote(
        &mut self,
        tokens: &[u32],
        from: usize,
        pages: &[u32],
        pool: &mut PagePool,
    ) -> usize {
        let path = self.walk(tokens);
        self.touch(&path);
        let (mut at, mut done) = (0, 0);
        for (id, n) in path {
            for i in 0..n {
                if at >= from && done < pages.len() {
                    let page = self.node(id).pages[i];
                    let Some(slot) = page.host.filter(|_| page.device.is_none()) else {
                        return done;
                    };
                    self.node_mut(id).pages[i].device = Some(pages[done]);
                    pool.hold(pages[done]);
                    self.copies.push(KvCopy::ToDevice {
                        slot,
                        page: pages[done],
                    });
                    self.pages += 1;
                    self.both += 1;
                    done += 1;
                }
                at += 1;
            }
        }
        done
    }

    fn insert(&mut self, tokens: &[u32], pages: &[u32], pool: &mut PagePool) -> Vec<u32> {
        assert_eq!(tokens.len(), pages.len() * self.page_size);
        let mut path = Vec::new();
        let mut out = Vec::with_capacity(pages.len());
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
                    pages: (pages[done..].iter())
                        .map(|&p| Page {
                            device: Some(p),
                            host: None,
                        })
                        .collect(),
                    children: HashMap::new(),
                    parent: node,
                    last_access: 0,
                });
                self.node_mut(node).children.insert(key.to_vec(), leaf);
                out.extend_from_slice(&pages[done..]);
                path.push((leaf, pages.len() - done));
                break;
            };
            let n = self.common_pages(child, &tokens[pos..]);
            let next = if n < self.node(child).pages.len() {
                self.split(child, n)
            } else {
                child
            };
            for i in 0..n {
                let mine = pages[done + i];
                let page = &mut self.node_mut(next).pages[i];
                match page.device {
                    Some(cached) => out.push(cached),
                    None => {
                        // Only in the host tier: adopt the copy this request computed.
                        page.device = Some(mine);
                        pool.hold(mine);
                        self.pages += 1;
                        self.both += 1;
                        out.push(mine);
                    }
                }
            }
            path.push((next, n));
            done += n;
            node = next;
        }
        self.touch(&path);
        out
    }

    fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize {
        let mut frontier: BinaryHeap<(Reverse<u64>, usize)> = (self.live())
            .filter(|&(id, _)| self.is_device_frontier(id))
            .map(|(id, n)| (Reverse(n.last_access), id))
            .collect();
        // Without a host tier no page is host-only: no walk for them.
        let mut host_leaves: BinaryHeap<(Reverse<u64>, usize)> = match self.host.capacity {
            0 => BinaryHeap::new(),
            _ => (self.live())
                .filter(|(_, n)| n.children.is_empty() && n.ends_host_only())
                .map(|(id, n)| (Reverse(n.last_access), id))
                .collect(),
        };
        let mut freed = 0;
        while freed < want {
            let Some((_, id)) = frontier.pop() else { break };
            if self.nodes[id].is_none() || !self.is_device_frontier(id) {
                continue;
            }
            while freed < want {
                let n = self.node(id);
                let Some(i) = n.device_len().checked_sub(1) else {
                    break;
                };
                let page = n.pages[i];
                let device = page.device.expect("a device page");
                if !pool.is_cache_only(device) {
                    break;
                }
                let last = i + 1 == n.pages.len() && n.children.is_empty();
                let host = match page.host {
                    Some(slot) => {
                        self.both -= 1;
                        Some(slot)
                    }
                    None => self.host_slot(&mut host_leaves),
                };
                match host {
                    Some(slot) => {
                        if page.host.is_none() {
                            self.copies.push(KvCopy::ToHost { page: device, slot });
                        }
                        self.node_mut(id).pages[i] = Page {
                            device: None,
                            host: Some(slot),
                        };
                        if self.node(id).children.is_empty() {
                            host_leaves.push((Reverse(self.node(id).last_access), id));
                        }
                    }
                    // No host tier: forget the page, from the tail of a leaf only.
                    None if last => {
                        let page_size = self.page_size;
                        let node = self.node_mut(id);
                        node.pages.pop();
                        let keep = node.pages.len() * page_size;
                        node.tokens.truncate(keep);
                    }
                    None => break,
                }
                pool.unhold(device);
                self.pages -= 1;
                freed += 1;
            }
            let parent = self.node(id).parent;
            if self.node(id).device_len() > 0 {
                continue; // a page a request holds stopped it
            }
            let parent = self.remove_if_empty(id).unwrap_or(parent);
            if self.is_device_frontier(parent) {
                frontier.push((Reverse(self.node(parent).last_access), parent));
            }
        }
        freed
    }

    fn cached_pages(&self) -> usize {
        self.pages
    }

    fn host_pages(&self) -> usize {
        self.host.used
    }

    fn take_copies(&mut self) -> Vec<KvCopy> {
        std::mem::take(&mut self.copies)
    }
}
