//! The scheduler's decisions as small pure functions.

/// Tokens a request runs this step: everything pending up to the step's remaining token
/// budget (a prefill longer than the budget is split into chunks).
pub fn chunk_len(pending: usize, budget: usize) -> usize {
    pending.min(budget)
}

/// New pages a request needs so that positions `0..kv_len` have a page, holding `have`.
pub fn pages_needed(kv_len: usize, page_size: usize, have: usize) -> usize {
    kv_len.div_ceil(page_size).saturating_sub(have)
}

/// The longest chunk a request can run with the pages it holds plus `available` more
/// (free or held only by the cache): a prefill that does not fit whole still progresses.
pub fn chunk_that_fits(computed: usize, held: usize, available: usize, page_size: usize) -> usize {
    ((held + available) * page_size).saturating_sub(computed)
}

/// How many cached pages a new request may reuse: its last prompt token is always run
/// (its logits give the first output token), and a page is shared only whole.
pub fn reusable_pages(hit_pages: usize, tokens: usize, page_size: usize) -> usize {
    hit_pages.min(tokens.saturating_sub(1) / page_size)
}

/// Whether a new request that may reuse `cached` pages now should rather wait for a
/// running prefill whose prompt shares `shared` whole pages with its `tokens`: once they
/// are computed (and cached, chunk by chunk) it reuses more than it can now.
pub fn waits_for_prefill(cached: usize, shared: usize, tokens: usize, page_size: usize) -> bool {
    reusable_pages(shared, tokens, page_size) > cached
}

/// Whether a request fits the pool at all: its longest possible context in pages.
pub fn fits_pool(prompt: usize, max_tokens: usize, page_size: usize, pool_pages: usize) -> bool {
    (prompt + max_tokens).div_ceil(page_size) <= pool_pages
}

/// The running request to preempt so that the one at `needy` can go on: the most recently
/// admitted one after it (the oldest requests keep going, so the oldest always finishes).
pub fn preemption_victim(running: usize, needy: usize) -> Option<usize> {
    (running > needy + 1).then(|| running - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefill_longer_than_the_budget_is_cut_to_the_budget() {
        assert_eq!(chunk_len(10_000, 2048), 2048);
        assert_eq!(chunk_len(1, 2048), 1);
    }

    #[test]
    fn a_new_page_is_needed_only_when_the_context_crosses_a_page_boundary() {
        assert_eq!(pages_needed(64, 64, 1), 0);
        assert_eq!(pages_needed(65, 64, 1), 1);
        assert_eq!(pages_needed(200, 64, 0), 4);
    }

    #[test]
    fn a_prefill_chunk_shrinks_to_the_pages_there_are() {
        // 100 tokens computed in 2 pages of 64; 1 more page available: up to 192 tokens.
        assert_eq!(chunk_that_fits(100, 2, 1, 64), 92);
        assert_eq!(chunk_that_fits(128, 2, 0, 64), 0);
    }

    #[test]
    fn a_fully_cached_prompt_still_recomputes_its_last_token() {
        // 128 prompt tokens, both pages cached: only the first page may be reused, so the
        // last token (in the second page) runs and gives logits.
        assert_eq!(reusable_pages(2, 128, 64), 1);
        assert_eq!(reusable_pages(2, 129, 64), 2);
        assert_eq!(reusable_pages(5, 1, 64), 0);
    }

    #[test]
    fn a_request_waits_only_for_a_prefill_that_gives_it_more_than_the_cache() {
        // 1000 tokens in pages of 64: at most 15 pages are reusable.
        assert!(waits_for_prefill(0, 1, 1000, 64));
        assert!(waits_for_prefill(3, 15, 1000, 64));
        assert!(!waits_for_prefill(3, 3, 1000, 64));
        assert!(!waits_for_prefill(15, 20, 1000, 64));
        // The shared pages hold the whole prompt: its last token still runs, on its own.
        assert!(!waits_for_prefill(0, 1, 64, 64));
    }

    #[test]
    fn a_request_longer_than_the_pool_does_not_fit() {
        assert!(fits_pool(100, 28, 64, 2));
        assert!(!fits_pool(100, 29, 64, 2));
    }

    #[test]
    fn the_newest_request_is_preempted_and_never_the_one_that_needs_pages() {
        assert_eq!(preemption_victim(5, 1), Some(4));
        assert_eq!(preemption_victim(2, 1), None);
        assert_eq!(preemption_victim(1, 0), None);
    }
}
