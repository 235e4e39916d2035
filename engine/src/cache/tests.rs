//! The radix tree against the flat oracle, and the eviction rules both follow.
use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

/// A cache and its pool driven the way the engine drives them, with a record of which
/// tokens each page was written with.
struct Harness {
    cache: Box<dyn PrefixCache>,
    pool: PagePool,
    page_size: usize,
    written: HashMap<u32, Vec<u32>>,
}

impl Harness {
    fn new(kind: CacheKind, page_size: usize, pages: usize) -> Self {
        Harness {
            cache: kind.build(page_size),
            pool: PagePool::new(pages),
            page_size,
            written: HashMap::new(),
        }
    }

    /// Looks up the longest cached prefix and checks its pages hold those tokens.
    fn lookup(&mut self, tokens: &[u32]) -> Vec<u32> {
        let pages = self.cache.lookup(tokens);
        for (i, p) in pages.iter().enumerate() {
            let span = &tokens[i * self.page_size..(i + 1) * self.page_size];
            assert_eq!(self.written[p], span, "page {p} holds other tokens");
        }
        pages
    }

    /// A request for `tokens`: reuses the cached prefix, computes the rest into new pages,
    /// caches every whole page and finishes. `None` if the pool is too full.
    fn serve(&mut self, tokens: &[u32]) -> Option<usize> {
        let full = tokens.len() / self.page_size;
        let hit = self.lookup(tokens);
        self.pool.retain(&hit);
        let Some(new) = self.pool.alloc(full - hit.len()) else {
            self.pool.release(&hit);
            return None;
        };
        for (i, &p) in new.iter().enumerate() {
            let at = (hit.len() + i) * self.page_size;
            self.written
                .insert(p, tokens[at..at + self.page_size].to_vec());
        }
        let pages: Vec<u32> = hit.iter().chain(&new).copied().collect();
        let whole = &tokens[..full * self.page_size];
        let cached = self.cache.insert(whole, &pages, &mut self.pool);
        assert_eq!(
            cached, pages,
            "one request at a time: nothing was cached twice"
        );
        self.pool.release(&pages);
        Some(hit.len())
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
            prop_assert_eq!(radix.lookup(s).len(), flat.lookup(s).len());
            prop_assert_eq!(radix.serve(s), flat.serve(s));
            prop_assert_eq!(radix.cache.cached_pages(), flat.cache.cached_pages());
            prop_assert_eq!(radix.pool.cache_only_pages(), radix.cache.cached_pages());
            prop_assert_eq!(radix.pool.request_pages(), 0);
        }
    }

    #[test]
    fn eviction_frees_what_it_says_and_keeps_every_hit_correct(
        kind in prop_oneof![Just(CacheKind::Radix), Just(CacheKind::Flat)],
        page_size in 1usize..4,
        seqs in sequences(),
        evictions in prop::collection::vec(0usize..6, 24),
    ) {
        let mut h = Harness::new(kind, page_size, 4096);
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
        let held = h.cache.lookup(&tokens);
        h.pool.retain(&held[..2]);
        assert_eq!(h.cache.evict(usize::MAX, &mut h.pool), 2, "{kind:?}");
        assert_eq!(h.cache.lookup(&tokens), held[..2].to_vec(), "{kind:?}");
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
    assert!(h.cache.lookup(&old).is_empty());
    assert_eq!(h.cache.lookup(&new).len(), 2);
}

#[test]
fn a_full_pool_refuses_a_request_without_leaking_its_hit() {
    let mut h = Harness::new(CacheKind::Radix, 2, 3);
    h.serve(&[5, 5, 6, 6]);
    assert_eq!(
        h.serve(&[5, 5, 7, 7, 8, 8]),
        None,
        "needs 2 new pages, 1 is free"
    );
    assert_eq!(h.pool.request_pages(), 0);
}
