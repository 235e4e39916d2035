//! The KV cache's host-side bookkeeping: the page pool (who holds which page) and the
//! prefix cache (which token prefixes already have KV in which pages).
//!
//! Two prefix caches implement one trait: the radix tree the engine runs and a flat list
//! kept as its test oracle (`--prefix-cache radix|flat`). Both are page-granular: only whole
//! pages are shared, so a request never writes into a page another request reads.
//!
//! Room for a host-RAM tier: a cached page is an id into the device pool today; a tier
//! below would give tree nodes a location (device or pinned host) and bring pages back on
//! a hit before the step that reads them.
mod flat;
mod pages;
mod radix;

pub use flat::FlatCache;
pub use pages::PagePool;
pub use radix::RadixCache;

/// A cache of token prefixes whose KV lives in pages of a [`PagePool`].
pub trait PrefixCache: Send {
    /// The pages holding the longest cached page-aligned prefix of `tokens` (marks it used).
    fn lookup(&mut self, tokens: &[u32]) -> Vec<u32>;

    /// Caches `tokens` (whole pages) stored in `pages`; the cache holds (in `pool`) the pages
    /// it newly keeps. Returns the pages the cache has for `tokens`: where a prefix was
    /// already cached in other pages (computed twice by concurrent requests), the cached
    /// ones. The caller switches to those, so a request's pages stay a path of the cache
    /// and everything the cache holds beyond it stays evictable.
    fn insert(&mut self, tokens: &[u32], pages: &[u32], pool: &mut PagePool) -> Vec<u32>;

    /// Frees up to `want` pages that only the cache holds, least recently used first, from
    /// the ends of cached sequences. Returns how many it freed.
    fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize;

    /// Pages the cache holds.
    fn cached_pages(&self) -> usize;
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
    /// An empty cache of this kind over pages of `page_size` tokens.
    pub fn build(self, page_size: usize) -> Box<dyn PrefixCache> {
        match self {
            CacheKind::Radix => Box::new(RadixCache::new(page_size)),
            CacheKind::Flat => Box::new(FlatCache::new(page_size)),
        }
    }
}

#[cfg(test)]
mod tests;
