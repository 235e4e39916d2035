//! The naive prefix cache: a flat list of cached sequences, each compared in full on every
//! lookup. Obviously correct and slow (linear in everything cached); the radix tree's
//! test oracle, selectable with `--prefix-cache flat`. It has no host tier: evicted pages
//! are forgotten.
use super::{common_pages, Hit, PagePool, PrefixCache};

#[derive(Debug)]
struct Entry {
    tokens: Vec<u32>,
    pages: Vec<u32>,
    last_access: u64,
}

/// Cached sequences in a list.
#[derive(Debug)]
pub struct FlatCache {
    page_size: usize,
    entries: Vec<Entry>,
    clock: u64,
}

impl FlatCache {
    /// An empty cache over pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size > 0);
        FlatCache {
            page_size,
            entries: Vec::new(),
            clock: 0,
        }
    }

    /// The entry sharing the most pages with `tokens`, and how many.
    fn best(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_pages(&e.tokens, tokens, self.page_size)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))
    }

    /// Pages entry `i` shares with some other entry (those stay while the other does).
    fn shared_pages(&self, i: usize) -> usize {
        (0..self.entries.len())
            .filter(|&j| j != i)
            .map(|j| {
                common_pages(
                    &self.entries[i].tokens,
                    &self.entries[j].tokens,
                    self.page_size,
                )
            })
            .max()
            .unwrap_or(0)
    }
}

impl PrefixCache for FlatCache {
    fn lookup(&mut self, tokens: &[u32]) -> Hit {
        self.clock += 1;
        let Some((i, n)) = self.best(tokens) else {
            return Hit::default();
        };
        self.entries[i].last_access = self.clock;
        Hit {
            device: self.entries[i].pages[..n].to_vec(),
            host: 0,
        }
    }

    fn promote(&mut self, _: &[u32], _: usize, _: &[u32], _: &mut PagePool) -> usize {
        0
    }

    fn insert(&mut self, tokens: &[u32], pages: &[u32], pool: &mut PagePool) -> Vec<u32> {
        assert_eq!(tokens.len(), pages.len() * self.page_size);
        self.clock += 1;
        let (known, n) = match self.best(tokens) {
            Some((i, n)) => (self.entries[i].pages[..n].to_vec(), n),
            None => (Vec::new(), 0),
        };
        if n == pages.len() {
            return known; // already cached (as a prefix of an entry)
        }
        for &p in &pages[n..] {
            pool.hold(p);
        }
        // An entry the new one extends is subsumed by it (its pages live on in the new one).
        let subsumed: Vec<bool> = (self.entries.iter())
            .map(|e| common_pages(&e.tokens, tokens, self.page_size) == e.pages.len())
            .collect();
        let mut keep = subsumed.iter().map(|s| !s);
        self.entries.retain(|_| keep.next().unwrap_or(true));
        let cached: Vec<u32> = known
            .into_iter()
            .chain(pages[n..].iter().copied())
            .collect();
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            pages: cached.clone(),
            last_access: self.clock,
        });
        cached
    }

    fn evict(&mut self, want: usize, pool: &mut PagePool) -> usize {
        let mut freed = 0;
        let mut stamps: Vec<u64> = self.entries.iter().map(|e| e.last_access).collect();
        stamps.sort_unstable();
        for stamp in stamps {
            if freed == want {
                break;
            }
            let Some(i) = self.entries.iter().position(|e| e.last_access == stamp) else {
                continue;
            };
            let shared = self.shared_pages(i);
            let e = &mut self.entries[i];
            while freed < want && e.pages.len() > shared {
                let p = *e.pages.last().expect("more pages than shared");
                if !pool.is_cache_only(p) {
                    break;
                }
                e.pages.pop();
                pool.unhold(p);
                freed += 1;
            }
            e.tokens.truncate(e.pages.len() * self.page_size);
            if e.pages.len() == shared {
                // Cut back to what another entry holds: that entry's prefix now.
                self.entries.remove(i);
            }
        }
        freed
    }

    fn cached_pages(&self) -> usize {
        (0..self.entries.len())
            .map(|i| {
                let longer_shared = (0..i)
                    .map(|j| {
                        common_pages(
                            &self.entries[i].tokens,
                            &self.entries[j].tokens,
                            self.page_size,
                        )
                    })
                    .max()
                    .unwrap_or(0);
                self.entries[i].pages.len() - longer_shared
            })
            .sum()
    }
}
