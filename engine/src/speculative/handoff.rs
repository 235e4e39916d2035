//! A drafter's per-request index, kept when its request ends and taken over by the next
//! request whose tokens begin with the ones it indexed: an agent's next turn re-sends the
//! whole history, and indexing 100k tokens again would hold the engine thread for tens of
//! milliseconds. The match is by a 64-bit rolling hash of the indexed prefix; a false match
//! could only cost acceptance, never output, since every draft is verified.
use std::collections::VecDeque;

/// Most indexes of ended requests kept for the requests that extend them (one per agent
/// session between its turns, for this many sessions)...
pub const RETAINED_INDEXES: usize = 256;
/// ...and at most this many bytes of them (a 100k-token index is 10-40 MB): the oldest go
/// first.
pub const RETAINED_BYTES: usize = 1 << 30;

/// An index over a request's first `indexed` tokens.
#[derive(Debug, Default)]
pub struct Indexed<T> {
    pub indexed: usize,
    /// [`prefix_hash`] of those tokens: whose tokens the index holds.
    hash: u64,
    pub data: T,
}

impl<T> Indexed<T> {
    /// The tokens before `to` are now in the index (`to` at least `indexed`).
    pub fn advance_to(&mut self, tokens: &[u32], to: usize) {
        for &t in &tokens[self.indexed..to] {
            self.hash = prefix_hash(self.hash, t);
        }
        self.indexed = to;
    }
}

/// A rolling hash of tokens, extended one token at a time.
fn prefix_hash(hash: u64, token: u32) -> u64 {
    hash.wrapping_mul(0x100_0000_01b3)
        .wrapping_add(u64::from(token) + 1)
}

/// The latest indexes of ended requests, within [`RETAINED_INDEXES`] and
/// [`RETAINED_BYTES`].
#[derive(Debug)]
pub struct Handoff<T> {
    /// Oldest first, each with its bytes.
    retained: VecDeque<(Indexed<T>, usize)>,
    bytes: usize,
}

impl<T> Default for Handoff<T> {
    fn default() -> Self {
        Handoff {
            retained: VecDeque::new(),
            bytes: 0,
        }
    }
}

impl<T> Handoff<T> {
    /// Keeps an ended request's index of `bytes` (the oldest kept go to make room).
    pub fn keep(&mut self, index: Indexed<T>, bytes: usize) {
        self.retained.push_back((index, bytes));
        self.bytes += bytes;
        while self.retained.len() > RETAINED_INDEXES || self.bytes > RETAINED_BYTES {
            let Some((_, gone)) = self.retained.pop_front() else {
                break;
            };
            self.bytes -= gone;
        }
    }

    /// The kept index of the longest prefix of `tokens` short of the last token, if any,
    /// taken out of the kept ones.
    pub fn take(&mut self, tokens: &[u32]) -> Option<Indexed<T>> {
        let usable = tokens.len().saturating_sub(1);
        // Candidates by the length they indexed, shortest first.
        let mut candidates: Vec<(usize, usize)> = (self.retained.iter().enumerate())
            .filter(|(_, (r, _))| r.indexed <= usable)
            .map(|(at, (r, _))| (r.indexed, at))
            .collect();
        candidates.sort_unstable();
        let longest = candidates.last()?.0;
        let (mut hash, mut best, mut next) = (0, None, 0);
        for (i, &t) in tokens[..longest].iter().enumerate() {
            hash = prefix_hash(hash, t);
            while next < candidates.len() && candidates[next].0 <= i + 1 {
                let (length, at) = candidates[next];
                if length == i + 1 && self.retained[at].0.hash == hash {
                    best = Some(at);
                }
                next += 1;
            }
        }
        let (index, bytes) = self.retained.remove(best?)?;
        self.bytes -= bytes;
        Some(index)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Indexed<T>> {
        self.retained.iter().map(|(r, _)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index_of(tokens: &[u32]) -> Indexed<()> {
        let mut index = Indexed::default();
        index.advance_to(tokens, tokens.len());
        index
    }

    #[test]
    fn the_longest_indexed_prefix_is_taken_and_the_oldest_go_first() {
        let history: Vec<u32> = (0..100).collect();
        let mut h = Handoff::default();
        h.keep(index_of(&[]), 1); // an index of nothing is never a match
        h.keep(index_of(&history[..40]), 1);
        h.keep(index_of(&history[..60]), 1);
        h.keep(index_of(&[7, 7, 7]), 1);
        let taken = h.take(&history).expect("a prefix was kept");
        assert_eq!(taken.indexed, 60, "the longest");
        assert!(h.take(&history[..50]).is_some_and(|t| t.indexed == 40));
        assert!(h.take(&history).is_none(), "each is taken once");
        assert!(h.take(&[7, 7, 7]).is_none(), "short of the last token only");
        assert_eq!(h.iter().count(), 2, "the empty and [7, 7, 7] remain");
        // Bytes bound what is kept.
        for i in 0..4 {
            h.keep(index_of(&[i]), RETAINED_BYTES / 3);
        }
        assert_eq!(h.iter().count(), 3);
        assert!(h.iter().all(|r| r.indexed == 1));
    }
}
