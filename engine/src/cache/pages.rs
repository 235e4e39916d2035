//! The page pool: which KV pages are free and who holds the others.
//!
//! Every page has a reference count: one per running request whose block table lists it,
//! plus one while the prefix cache holds it. A page returns to the free list when its count
//! reaches zero. Pages held only by the cache are "evictable": KV usage counts the pages
//! requests hold, not the cache's spare copies.

/// Reference counts and the free list of a pool of `total` pages.
#[derive(Debug)]
pub struct PagePool {
    refs: Vec<u32>,
    cached: Vec<bool>,
    free: Vec<u32>,
    /// Pages whose only reference is the cache's.
    cache_only: usize,
}

impl PagePool {
    /// A pool of `total` free pages.
    pub fn new(total: usize) -> Self {
        PagePool {
            refs: vec![0; total],
            cached: vec![false; total],
            // Popped from the back: hand out low page ids first.
            free: (0..total as u32).rev().collect(),
            cache_only: 0,
        }
    }

    /// Pages in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Pages nobody holds.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages held only by the prefix cache (evictable).
    pub fn cache_only_pages(&self) -> usize {
        self.cache_only
    }

    /// Pages some request holds.
    pub fn request_pages(&self) -> usize {
        self.total() - self.free.len() - self.cache_only
    }

    /// `n` free pages, each held once by the caller; `None` (taking nothing) if fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let pages = self.free.split_off(self.free.len() - n);
        for &p in &pages {
            self.refs[p as usize] = 1;
        }
        Some(pages)
    }

    /// A request takes one more reference on each of `pages`.
    pub fn retain(&mut self, pages: &[u32]) {
        for &p in pages {
            self.set_refs(p, self.refs[p as usize] + 1);
        }
    }

    /// A request drops its reference on each of `pages`.
    pub fn release(&mut self, pages: &[u32]) {
        for &p in pages {
            let r = self.refs[p as usize];
            assert!(r > 0, "page {p} released more often than held");
            self.set_refs(p, r - 1);
        }
    }

    /// The cache starts holding `page` (once, however often it is asked).
    pub fn hold(&mut self, page: u32) {
        let i = page as usize;
        assert!(
            self.refs[i] > 0,
            "page {page} is free: allocate it before holding it"
        );
        if !self.cached[i] {
            // Held by its writer as well, so never cache-only right after this.
            self.cached[i] = true;
            self.refs[i] += 1;
        }
    }

    /// The cache stops holding `page`.
    pub fn unhold(&mut self, page: u32) {
        assert!(
            self.cached[page as usize],
            "page {page} is not held by the cache"
        );
        let r = self.refs[page as usize];
        if r == 1 {
            self.cache_only -= 1;
        }
        self.cached[page as usize] = false;
        self.set_refs(page, r - 1);
    }

    /// Whether only the cache holds `page`, so evicting it frees it.
    pub fn is_cache_only(&self, page: u32) -> bool {
        self.cached[page as usize] && self.refs[page as usize] == 1
    }

    /// (references, pages the cache holds), summed over all pages: for invariant checks.
    #[cfg(test)]
    pub(crate) fn totals(&self) -> (usize, usize) {
        let refs = self.refs.iter().map(|&r| r as usize).sum();
        (refs, self.cached.iter().filter(|&&c| c).count())
    }

    /// Sets a page's count, keeping the free list and the cache-only count in step.
    fn set_refs(&mut self, page: u32, new: u32) {
        let i = page as usize;
        let (old, cached) = (self.refs[i], self.cached[i]);
        if cached && old == 1 {
            self.cache_only -= 1;
        }
        if cached && new == 1 {
            self.cache_only += 1;
        }
        assert!(old > 0, "page {page} is free");
        if new == 0 {
            self.free.push(page);
        }
        self.refs[i] = new;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_takes_pages_off_the_free_list_and_release_returns_them() {
        let mut pool = PagePool::new(4);
        let pages = pool.alloc(3).unwrap();
        assert_eq!(pool.free_pages(), 1);
        assert!(pool.alloc(2).is_none(), "only one page is left");
        pool.release(&pages);
        assert_eq!(pool.free_pages(), 4);
    }

    #[test]
    fn a_page_held_by_the_cache_and_a_request_is_freed_only_when_both_let_go() {
        let mut pool = PagePool::new(2);
        let p = pool.alloc(1).unwrap()[0];
        pool.hold(p);
        pool.hold(p);
        assert_eq!(pool.request_pages(), 1);
        pool.release(&[p]);
        assert!(pool.is_cache_only(p));
        assert_eq!((pool.request_pages(), pool.cache_only_pages()), (0, 1));
        pool.unhold(p);
        assert_eq!(pool.free_pages(), 2);
    }

    #[test]
    fn a_cached_page_taken_by_a_new_request_is_no_longer_evictable() {
        let mut pool = PagePool::new(1);
        let p = pool.alloc(1).unwrap()[0];
        pool.hold(p);
        pool.release(&[p]);
        pool.retain(&[p]);
        assert!(!pool.is_cache_only(p));
        assert_eq!(pool.request_pages(), 1);
    }
}
