//! The KV cache's host-side bookkeeping: the page pool (who holds which page) and the
//! prefix cache (which token prefixes already have KV in which pages).
//!
//! Two prefix caches implement one trait: the radix tree the engine runs and a flat list
//! kept as its test oracle (`--prefix-cache radix|flat`). Both are page-granular: only whole
//! pages are shared, so a request never writes into a page another request reads.
//!
//! The radix tree has a second tier in host RAM (the write-up's HiCache L2): a cached page
//! lives on the device, in a host slot, or both. Eviction demotes the least recently used
//! pages to host slots (a copy out) instead of forgetting them, and drops host pages only
//! when the host tier is full; a lookup that reaches host pages gets them back into device
//! pages the request allocates (a copy in). The copies are queued ([`KvCopy`]) and applied
//! in order before the step that follows, so the bookkeeping is always a valid sequential
//! history of the data. Cached pages never change once written (only whole computed pages
//! are cached), so a host copy never goes stale.
mod flat;
mod pages;
mod radix;

pub use flat::FlatCache;
pub use pages::PagePool;
pub use radix::RadixCache;

/// Whole pages of `page_size` tokens that `a` and `b` share from their start.
pub(crate) fn common_pages(a: &[u32], b: &[u32], page_size: usize) -> usize {
    (a.chunks_exact(page_size).zip(b.chunks_exact(page_size)))
        .take_while(|(x, y)| x == y)
        .count()
}

/// The longest cached page-aligned prefix of some tokens: its first pages on the device,
/// then `host` more whose KV is only in the host tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Hit {
    pub device: Vec<u32>,
    pub host: usize,
}

/// One page's KV moved between the tiers: every layer's rows of a device page, as the pool
/// stores them, to or from a host slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCopy {
    /// Device page `page` -> host slot `slot` (a demotion).
    ToHost { page: u32, slot: u32 },
    /// Host slot `slot` -> device page `page` (a host hit brought back).
    ToDevice { slot: u32, page: u32 },
}

/// A cache of token prefixes whose KV lives in pages of a [`PagePool`] (and, for a cache
/// with a host tier, in host slots).
pub trait PrefixCache: Send {
    /// The longest cached page-aligned prefix of `tokens` (marks it used).
    fn lookup(&mut self, tokens: &[u32]) -> Hit;

    /// Brings the host pages of `tokens` that follow its first `from` pages (its device
    /// prefix) back to the device, into `pages` (allocated by the caller, who keeps its
    /// reference; the cache holds them too): as many as are still cached, at most
    /// `pages.len()`. Queues a [`KvCopy::ToDevice`] for each; returns how many.
    fn promote(&mut self, tokens: &[u32], from: usize, pages: &[u32], pool: &mut PagePool)
        -> usize;

    /// Caches `tokens` (whole pages) stored in `pages`; the cache holds (in `pool`) the pages
    /// it newly keeps. Returns the pages the cache has for `tokens`: where a prefix was
    /// already cached in other pages (computed twice by concurrent requests), the cached
    /// ones. The caller switches to those, so a request's pages stay a path of the cache
    /// and everything the cache holds beyond it stays evictable.
    fn insert(&mut self, tokens: &[u32], pages: &[u32], pool: &mut PagePool) -> Vec<u32>;

    /// Frees up to `want` device pages that only the cache holds, least recently used first,
    /// from the ends of cached sequences: demoted to the host tier where it has room (each
    /// a queued [`KvCopy::ToHost`]), else forgotten. Returns how many it freed.
    fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize;

    /// Device pages the cache holds.
    fn cached_pages(&self) -> usize;

    /// Host slots the cache holds.
    fn host_pages(&self) -> usize {
        0
    }

    /// The copies queued since the last call, in the order they must be applied.
    fn take_copies(&mut self) -> Vec<KvCopy> {
        Vec::new()
    }
}

/// Which prefix cache to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    /// The radix tree (default).
    Radix,
    /// The flat list: the naive oracle, linear in the cache's size.
    Flat,
}

impl CacheKind {
    /// An empty cache of this kind over pages of `page_size` tokens, with `host_slots`
    /// pages of host tier (the radix tree only: the flat oracle has none).
    pub fn build(self, page_size: usize, host_slots: usize) -> Box<dyn PrefixCache> {
        match self {
            CacheKind::Radix => Box::new(RadixCache::with_host_tier(page_size, host_slots)),
            CacheKind::Flat => Box::new(FlatCache::new(page_size)),
        }
    }
}

#[cfg(test)]
mod tests;
