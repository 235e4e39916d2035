//! Pages for running requests: taken from the free list, then by evicting cached prefixes,
//! then by preempting newer requests; prefill chunks lengthened by what admission left.
use super::*;

/// Fewest pages one eviction frees when the free list runs short.
const EVICT_BATCH: usize = 16;

impl Scheduler {
    /// Lengthens the prefill chunks planned short of what is pending by what is left of the
    /// step's `budget` (the part held back for admission that it did not take), in
    /// admission order, from pages free or held only by the cache (no preemption).
    pub(super) fn extend_chunks(&mut self, plan: &mut [usize], mut budget: usize) {
        let page = self.cfg.page_size;
        for (i, planned) in plan.iter_mut().enumerate() {
            let r = &self.running[i];
            if budget == 0 {
                return;
            }
            if *planned == 0 || r.decodes() {
                continue;
            }
            let available = self.pool.free_pages() + self.pool.cache_only_pages();
            let fits = policy::chunk_that_fits(r.computed, r.pages.len(), available, page);
            let extra = (r.pending() - *planned)
                .min(budget)
                .min(fits.saturating_sub(*planned));
            if extra == 0 {
                continue;
            }
            let need = policy::pages_needed(r.computed + *planned + extra, page, r.pages.len());
            if let Some(pages) = self.take_pages(need) {
                self.running[i].pages.extend(pages);
                *planned += extra;
                budget -= extra;
            }
        }
    }

    /// Reserves pages for `n` tokens of running request `i`, or for the longest chunk the
    /// pool can still give it; the tokens it will run, `None` if none.
    pub(super) fn plan_one(&mut self, i: usize, n: usize, plan: &mut Vec<usize>) -> Option<usize> {
        if self.reserve(i, n, plan) {
            return Some(n);
        }
        let r = &self.running[i];
        let available = self.pool.free_pages() + self.pool.cache_only_pages();
        let fit = policy::chunk_that_fits(r.computed, r.pages.len(), available, self.cfg.page_size)
            .min(n);
        (fit > 0 && self.reserve(i, fit, plan)).then_some(fit)
    }

    /// Gives running request `i` pages for `n` more tokens: from the free list, then by
    /// evicting cached prefixes, then by preempting newer requests not yet planned.
    fn reserve(&mut self, i: usize, n: usize, plan: &mut Vec<usize>) -> bool {
        let r = &self.running[i];
        let need = policy::pages_needed(r.computed + n, self.cfg.page_size, r.pages.len());
        loop {
            if let Some(pages) = self.take_pages(need) {
                self.running[i].pages.extend(pages);
                return true;
            }
            match policy::preemption_victim(self.running.len(), i) {
                Some(v) if plan[v] == 0 => {
                    plan.pop();
                    self.preempt(v);
                }
                _ => return false,
            }
        }
    }

    /// `n` pages from the free list, evicting cached prefixes if needed (at least
    /// [`EVICT_BATCH`] pages at a time: each eviction walks the cache's leaves); `None`,
    /// evicting nothing, if the free pages and those only the cache holds are too few.
    pub(super) fn take_pages(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.pool.free_pages() + self.pool.cache_only_pages() {
            return None;
        }
        let short = n.saturating_sub(self.pool.free_pages());
        if short > 0 {
            self.cache.evict(short.max(EVICT_BATCH), &mut self.pool);
        }
        self.pool.alloc(n)
    }

    /// Moves running request `v` back to the front of the queue, its pages freed (the whole
    /// pages it computed stay in the prefix cache).
    pub(super) fn preempt(&mut self, v: usize) {
        let mut r = self.running.remove(v);
        tracing::debug!(id = r.id, computed = r.computed, "preempted");
        self.metrics.preemptions.add(1);
        cache_computed(&mut *self.cache, &mut self.pool, self.cfg.page_size, &mut r);
        // A token still on the device is drawn again when it comes back (the same draw:
        // sampling is keyed by seed and position); the step in flight's is ignored.
        if r.unresolved.take().is_some() {
            r.tokens.pop();
        }
        self.pool.release(&r.pages);
        r.pages.clear();
        r.computed = 0;
        self.waiting.push_front(r);
    }
}
