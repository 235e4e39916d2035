//! A drafter's per-request index, kept when its request ends and taken over by the next
//! request whose tokens begin with the ones it indexed: an agent's next turn re-sends the
//! whole history, and indexing 100k tokens again would hold the engine thread for tens of
//! milliseconds. The match is by a 64-bit rolling hash of the indexed prefix; a false match
//! could only cost acceptance, never output, since every draft is verified.
use std::collections::VecDeque;

/// Indexes of ended requests kept for the requests that extend them.
pub const RETAINED_INDEXES: usize = 8;

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

/// The latest [`RETAINED_INDEXES`] indexes of ended requests.
#[derive(Debug)]
pub struct Handoff<T> {
    retained: VecDeque<Indexed<T>>,
}

impl<T> Default for Handoff<T> {
    fn default() -> Self {
        Handoff {
            retained: VecDeque::new(),
        }
    }
}

impl<T> Handoff<T> {
    /// Keeps an ended request's index (the oldest kept goes).
    pub fn keep(&mut self, index: Indexed<T>) {
        if self.retained.len() == RETAINED_INDEXES {
            self.retained.pop_front();
        }
        self.retained.push_back(index);
    }

    /// The kept index of the longest prefix of `tokens` short of the last token, if any,
    /// taken out of the kept ones.
    pub fn take(&mut self, tokens: &[u32]) -> Option<Indexed<T>> {
        let usable = tokens.len().saturating_sub(1);
        let longest = self
            .retained
            .iter()
            .map(|r| r.indexed)
            .filter(|&n| n <= usable)
            .max()?;
        let (mut hash, mut best) = (0, None);
        for (i, &t) in tokens[..longest].iter().enumerate() {
            hash = prefix_hash(hash, t);
            let fits = |r: &Indexed<T>| r.indexed == i + 1 && r.hash == hash;
            if let Some(at) = self.retained.iter().position(fits) {
                best = Some(at);
            }
        }
        best.and_then(|at| self.retained.remove(at))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Indexed<T>> {
        self.retained.iter()
    }
}
