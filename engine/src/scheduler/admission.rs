//! Admission: which waiting request starts next, with how much of the prefix cache.
//!
//! Waiting requests are taken in order, past any that waits for a running prefill of its
//! prefix: one whose prompt shares more whole pages with a prefill in progress than the
//! cache gives it yet starts once the cache holds them (the prefill puts its pages there
//! chunk by chunk), so requests sent together with one long prefix compute it once.
use super::*;
use crate::cache::common_pages;

/// Most waiting requests one admission looks at past those that wait for a running
/// prefill (each look is a cache lookup and a prompt comparison).
const ADMISSION_SCAN: usize = 64;

impl Scheduler {
    /// Admits the first waiting request that need not wait for a running prefill
    /// ([`Self::waits_for_prefill`]) with its first chunk; `None` if there is none or its
    /// pages cannot be had without preempting (new requests never preempt running ones).
    ///
    /// A hit's host pages are brought back into pages allocated with the chunk's: as many as
    /// the host tier still has once those are taken (taking them may evict).
    pub(super) fn admit(&mut self, budget: usize) -> Option<usize> {
        let page = self.cfg.page_size;
        let (at, hit, reusable) = (0..self.waiting.len().min(ADMISSION_SCAN)).find_map(|w| {
            if self.still_waits(w) {
                return None;
            }
            let tokens = &self.waiting[w].tokens;
            let hit = self.cache.lookup(tokens);
            let reusable = policy::reusable_pages(hit.device.len() + hit.host, tokens.len(), page);
            (!self.waits_for_prefill(w, reusable)).then_some((w, hit, reusable))
        })?;
        let r = &self.waiting[at];
        let device = &hit.device[..reusable.min(hit.device.len())];
        let host = reusable - device.len();
        self.pool.retain(device);
        let n = policy::chunk_len(r.tokens.len() - reusable * page, budget);
        let need = policy::pages_needed(reusable * page + n, page, device.len());
        let Some(new) = self.take_pages(need) else {
            self.pool.release(device);
            return None;
        };
        let mut r = self.waiting.remove(at).expect("looked at above");
        let promoted = (self.cache).promote(&r.tokens, device.len(), &new[..host], &mut self.pool);
        let computed = (device.len() + promoted) * page;
        if r.cached.is_none() {
            r.cached = Some(computed);
            self.metrics.prompt_tokens.add(r.prompt_len as u64);
            self.metrics.cached_tokens.add(computed as u64);
            self.metrics
                .host_cached_tokens
                .add((promoted * page) as u64);
            r.send(Event::Admitted {
                cached_tokens: computed,
            });
            tracing::debug!(id = r.id, session = ?r.session, cached = computed, "admitted");
        }
        r.computed = computed;
        r.in_cache = device.len() + promoted;
        r.pages = device.iter().copied().chain(new).collect();
        self.running.push(r);
        Some(n)
    }

    /// Whether waiting request `w`, which the cache gives `cached` whole pages now, is
    /// better started later: a running request whose prompt's pages the cache does not
    /// all hold yet (it is prefilling, or its last chunk is in flight) shares more whole
    /// pages with `w`'s prompt ([`policy::waits_for_prefill`]), and the cache will hold
    /// them chunk by chunk as they are computed. Requests sent together with one long prefix
    /// (an agent's parallel calls, retries) then compute it once. The request remembers
    /// the prefill it waits for (the one that shares the most), see [`Self::still_waits`].
    fn waits_for_prefill(&mut self, w: usize, cached: usize) -> bool {
        let tokens = &self.waiting[w].tokens;
        let page = self.cfg.page_size;
        let source = (self.running.iter())
            .filter(|r| r.in_cache < r.prompt_len / page && r.stalled_since.is_none())
            .map(|r| (r.id, common_pages(tokens, &r.tokens[..r.prompt_len], page)))
            .filter(|&(_, shared)| policy::waits_for_prefill(cached, shared, tokens.len(), page))
            .max_by_key(|&(_, shared)| shared);
        let r = &mut self.waiting[w];
        if source.is_some() && r.waits_for.is_none() {
            self.metrics.prefill_waits.add(1);
            tracing::debug!(
                id = r.id,
                cached,
                "waits for a running prefill of its prefix"
            );
        }
        r.waits_for = source;
        source.is_some()
    }

    /// Whether waiting request `w` still waits for the prefill it waited for when last
    /// looked at: that request runs, unpaused, and the cache does not hold the pages they
    /// share yet. It saves a cache lookup and a prompt comparison a step for each request
    /// that waits.
    fn still_waits(&self, w: usize) -> bool {
        let Some((source, shared)) = self.waiting[w].waits_for else {
            return false;
        };
        (self.running.iter())
            .any(|r| r.id == source && r.in_cache < shared && r.stalled_since.is_none())
    }
}
