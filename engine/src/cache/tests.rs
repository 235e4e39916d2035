//! The radix tree against the flat oracle, and the eviction rules both follow.
use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// A cache and its pool driven the way the engine drives them, with a record of which
/// tokens each device page and host slot holds (copies applied as the engine applies them).
struct Harness {
    cache: Box<dyn PrefixCache>,
    pool: PagePool,
    page_size: usize,
    written: HashMap<u32, Vec<u32>>,
    host_written: HashMap<u32, Vec<u32>>,
    host_slots: usize,
}

impl Harness {
    fn new(kind: CacheKind, page_size: usize, pages: usize) -> Self {
        Self::tiered(kind, page_size, pages, 0)
    }

    fn tiered(kind: CacheKind, page_size: usize, pages: usize, host_slots: usize) -> Self {
        Harness {
            cache: kind.build(page_size, host_slots),
            pool: PagePool::new(pages),
            page_size,
            written: HashMap::new(),
            host_written: HashMap::new(),
            host_slots,
        }
    }

    /// Looks up the longest cached prefix and checks its device pages hold those tokens.
    fn lookup(&mut self, tokens: &[u32]) -> Hit {
        let hit = self.cache.lookup(tokens);
        for (i, p) in hit.device.iter().enumerate() {
            let span = &tokens[i * self.page_size..(i + 1) * self.page_size];
            assert_eq!(self.written[p], span, "page {p} holds other tokens");
        }
        hit
    }

    /// Applies the queued copies in order, as the engine does before a step.
    fn copy(&mut self) {
        for c in self.cache.take_copies() {
            match c {
                KvCopy::ToHost { page, slot } => {
                    assert!(
                        (slot as usize) < self.host_slots,
                        "slot {slot} beyond the tier"
                    );
                    self.host_written.insert(slot, self.written[&page].clone());
                }
                KvCopy::ToDevice { slot, page } => {
                    self.written.insert(page, self.host_written[&slot].clone());
                }
            }
        }
    }

    /// `n` pages, evicting cached ones as the scheduler does when the pool is short.
    fn take_pages(&mut self, n: usize) -> Option<Vec<u32>> {
        let short = n.saturating_sub(self.pool.free_pages());
        if short > 0 {
            self.cache.evict(short, &mut self.pool);
        }
        self.pool.alloc(n)
    }

    /// A request for `tokens`: reuses the cached prefix (bringing host pages back), computes
    /// the rest into new pages, caches every whole page and finishes. Returns the pages hit
    /// (device and host); `None` if the pool is too full.
    fn serve(&mut self, tokens: &[u32]) -> Option<usize> {
        let full = tokens.len() / self.page_size;
        let hit = self.lookup(tokens);
        let d = hit.device.len();
        self.pool.retain(&hit.device);
        let Some(new) = self.take_pages(full - d) else {
            self.pool.release(&hit.device);
            self.copy();
            return None;
        };
        let promoted = self
            .cache
            .promote(tokens, d, &new[..hit.host], &mut self.pool);
        assert!(promoted <= hit.host);
        self.copy();
        for (i, &p) in new.iter().enumerate() {
            let at = (d + i) * self.page_size;
            let span = &tokens[at..at + self.page_size];
            if i < promoted {
                assert_eq!(
                    self.written[&p], span,
                    "host slot brought back other tokens"
                );
            } else {
                self.written.insert(p, span.to_vec());
            }
        }
        let pages: Vec<u32> = hit.device.iter().chain(&new).copied().collect();
        let whole = &tokens[..full * self.page_size];
        let cached = self.cache.insert(whole, &pages, &mut self.pool);
        assert_eq!(
            cached, pages,
            "one request at a time: nothing was cached twice"
        );
        self.pool.release(&pages);
        self.check();
        Some(d + promoted)
    }

    /// The pool's and the tiers' accounting agree.
    fn check(&self) {
        assert_eq!(self.pool.totals().1, self.cache.cached_pages());
        assert!(self.cache.host_pages() <= self.host_slots);
        assert_eq!(
            self.pool.free_pages() + self.pool.cache_only_pages() + self.pool.request_pages(),
            self.pool.total()
        );
    }
}

fn sequences() -> impl Strategy<Value = Vec<Vec<u32>>> {
    // A two-letter alphabet and short pages make shared prefixes and splits common.
    prop::collection::vec(prop::collection::vec(0u32..2, 0..24), 1..24)
}

proptest! {
    #[test]
    fn the_radix_tree_matches_what_the_flat_cache_matches(
        page_size in 1usize..4,
        seqs in sequences(),
    ) {
        let mut radix = Harness::new(CacheKind::Radix, page_size, 4096);
        let mut flat = Harness::new(CacheKind::Flat, page_size, 4096);
        for s in &seqs {
            prop_assert_eq!(radix.lookup(s).device.len(), flat.lookup(s).device.len());
            prop_assert_eq!(radix.serve(s), flat.serve(s));
            prop_assert_eq!(radix.cache.cached_pages(), flat.cache.cached_pages());
            prop_assert_eq!(radix.pool.cache_only_pages(), radix.cache.cached_pages());
            prop_assert_eq!(radix.pool.request_pages(), 0);
        }
    }

    #[test]
    fn eviction_frees_what_it_says_and_keeps_every_hit_correct(
        kind in prop_oneof![Just(CacheKind::Radix), Just(CacheKind::Flat)],
        host_slots in prop_oneof![Just(0usize), 1usize..8],
        page_size in 1usize..4,
        seqs in sequences(),
        evictions in prop::collection::vec(0usize..6, 24),
    ) {
        let mut h = Harness::tiered(kind, page_size, 4096, host_slots);
        for (s, &want) in seqs.iter().zip(&evictions) {
            h.serve(s);
            let cached = h.cache.cached_pages();
            let freed = h.cache.evict(want, &mut h.pool);
            prop_assert_eq!(freed, want.min(cached));
            prop_assert_eq!(h.cache.cached_pages(), cached - freed);
            prop_assert_eq!(h.pool.free_pages() + h.pool.cache_only_pages(), h.pool.total());
            h.lookup(s);
        }
        let all = h.cache.cached_pages();
        prop_assert_eq!(h.cache.evict(usize::MAX, &mut h.pool), all);
        prop_assert_eq!(h.pool.free_pages(), h.pool.total());
    }

    /// With room in the host tier, a device pool too small to keep anything between
    /// requests loses no prefix: every hit (device and host pages) is the flat cache's on
    /// a pool that never evicts, and every page brought back holds its tokens.
    #[test]
    fn a_host_tier_keeps_every_prefix_the_device_pool_drops(
        page_size in 1usize..4,
        extra in 0usize..6,
        seqs in sequences(),
    ) {
        let mut tiered = Harness::tiered(CacheKind::Radix, page_size, 24 + extra, 4096);
        let mut flat = Harness::new(CacheKind::Flat, page_size, 4096);
        for s in &seqs {
            let want = flat.serve(s);
            prop_assert_eq!(tiered.serve(s), want);
        }
    }

    /// A host tier smaller than what was evicted drops pages but never returns wrong KV,
    /// never hits more than the flat cache on a pool that never evicts, and never holds
    /// more slots than it has; evicting everything empties the device pool.
    #[test]
    fn a_full_host_tier_drops_pages_but_never_returns_wrong_ones(
        page_size in 1usize..4,
        extra in 0usize..6,
        host_slots in 1usize..12,
        seqs in sequences(),
        evictions in prop::collection::vec(0usize..6, 24),
    ) {
        let mut tiered = Harness::tiered(CacheKind::Radix, page_size, 24 + extra, host_slots);
        let mut flat = Harness::new(CacheKind::Flat, page_size, 4096);
        for (s, &want) in seqs.iter().zip(&evictions) {
            let most = flat.serve(s).unwrap();
            prop_assert!(tiered.serve(s).unwrap() <= most);
            let cached = tiered.cache.cached_pages();
            prop_assert_eq!(tiered.cache.evict(want, &mut tiered.pool), want.min(cached));
            tiered.copy();
            tiered.check();
        }
        let all = tiered.cache.cached_pages();
        prop_assert_eq!(tiered.cache.evict(usize::MAX, &mut tiered.pool), all);
        tiered.copy();
        prop_assert_eq!(tiered.pool.free_pages(), tiered.pool.total());
        prop_assert!(tiered.cache.host_pages() <= host_slots);
        for s in &seqs {
            let hit = tiered.lookup(s);
            prop_assert!(hit.device.is_empty());
            prop_assert!(hit.host <= flat.lookup(s).device.len());
        }
    }
}

#[test]
fn a_prefix_evicted_to_the_host_tier_comes_back_by_copy() {
    let mut h = Harness::tiered(CacheKind::Radix, 2, 4, 8);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (10..18).collect();
    assert_eq!(h.serve(&a), Some(0));
    assert_eq!(h.serve(&b), Some(0), "A's four pages went to the host tier");
    assert_eq!(h.cache.host_pages(), 4);
    assert_eq!(
        h.lookup(&a),
        Hit {
            device: vec![],
            host: 4
        }
    );
    assert_eq!(h.serve(&a), Some(4), "all of A hits, from the host");
    assert_eq!(h.cache.host_pages(), 8, "B went down, A's copies stay");
    assert_eq!(h.serve(&a), Some(4), "and now from the device");
}

#[test]
fn a_second_request_with_the_same_prefix_hits_every_whole_page() {
    let mut h = Harness::new(CacheKind::Radix, 4, 64);
    let first: Vec<u32> = (0..10).collect();
    assert_eq!(h.serve(&first), Some(0));
    let second: Vec<u32> = (0..8).chain([99, 98, 97, 96]).collect();
    assert_eq!(
        h.serve(&second),
        Some(2),
        "pages [0..4) and [4..8) are shared"
    );
}

#[test]
fn pages_a_running_request_holds_are_never_evicted() {
    for kind in [CacheKind::Radix, CacheKind::Flat] {
        let mut h = Harness::new(kind, 2, 16);
        let tokens: Vec<u32> = (0..8).collect();
        h.serve(&tokens);
        let held = h.cache.lookup(&tokens).device;
        h.pool.retain(&held[..2]);
        assert_eq!(h.cache.evict(usize::MAX, &mut h.pool), 2, "{kind:?}");
        assert_eq!(
            h.cache.lookup(&tokens).device,
            held[..2].to_vec(),
            "{kind:?}"
        );
    }
}

#[test]
fn the_least_recently_used_sequence_is_evicted_first() {
    let mut h = Harness::new(CacheKind::Radix, 2, 16);
    let (old, new) = (vec![1, 1, 1, 1], vec![2, 2, 2, 2]);
    h.serve(&old);
    h.serve(&new);
    h.lookup(&new);
    assert_eq!(h.cache.evict(2, &mut h.pool), 2);
    assert!(h.cache.lookup(&old).device.is_empty());
    assert_eq!(h.cache.lookup(&new).device.len(), 2);
}

#[test]
fn a_full_pool_refuses_a_request_without_leaking_its_hit() {
    let mut h = Harness::new(CacheKind::Radix, 2, 3);
    h.serve(&[5, 5, 6, 6]);
    // Still running: its pages cannot be evicted.
    let running = h.cache.lookup(&[5, 5, 6, 6]).device;
    h.pool.retain(&running);
    assert_eq!(
        h.serve(&[5, 5, 7, 7, 8, 8]),
        None,
        "needs 2 new pages, 1 is free"
    );
    assert_eq!(h.pool.request_pages(), 2, "only the running request's");
}
