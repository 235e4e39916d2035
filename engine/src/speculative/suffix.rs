//! The suffix drafter (`--speculative suffix`): SuffixDecoding's idea (Oliaro et al., arXiv
//! 2411.04975) in kiln's own form. Every context of 1 to [`MAX_CONTEXT`] tokens in a
//! request's prompt and output maps to the tokens that followed it, with counts; so does
//! every context in the recent outputs of all requests (a bounded global table: agents
//! repeat tool calls and edits across sessions). A draft is a token tree grown best-first
//! ([`grow`]): a node's candidates are the continuations of the longest context matching
//! the tokens up to it (the request's own table first, then the global one at each
//! length), each scored by its path's probability, the product of the frequencies along
//! it; the most probable candidate joins the tree next, while it is at least
//! [`MIN_PATH_PROB`] and the tree is under its size limit. A long, consistent match
//! drafts a deep chain, an ambiguous one a few short branches or nothing. A request's
//! table is extended by the tokens appended since its last proposal (never rebuilt) and
//! handed to its next turn ([`super::handoff`]).
use std::collections::HashMap;
use std::mem::size_of;

use super::handoff::{Handoff, Indexed};
use super::{Draft, Drafter, ROOT};

/// Longest context matched, in tokens.
pub const MAX_CONTEXT: usize = 6;
/// Continuations kept per context: the most frequent (a newcomer takes the rarest one's
/// place, with its count plus one).
pub const BRANCHES: usize = 4;
/// A draft goes on while the product of its tokens' frequencies is at least this.
pub const MIN_PATH_PROB: f64 = 0.1;
/// Contexts in the global table: two generations of half this each; when the newer fills,
/// the older is dropped.
pub const GLOBAL_CONTEXTS: usize = 1 << 20;

/// The tokens that followed one context, with counts (inline: no allocation per context).
#[derive(Clone, Copy, Debug, Default)]
struct Continuations {
    next: [(u32, u32); BRANCHES],
    len: usize,
}

impl Continuations {
    fn add(&mut self, token: u32) {
        let kept = &mut self.next[..self.len];
        if let Some(c) = kept.iter_mut().find(|c| c.0 == token) {
            c.1 += 1;
        } else if self.len < BRANCHES {
            self.next[self.len] = (token, 1);
            self.len += 1;
        } else if let Some(rarest) = self.next.iter_mut().min_by_key(|c| c.1) {
            *rarest = (token, rarest.1 + 1);
        }
    }

    /// The continuations with their shares, most frequent first.
    fn shares(&self) -> Vec<(u32, f64)> {
        by_frequency(&self.next[..self.len])
    }
}

/// `(token, count)` pairs as `(token, share)`, most frequent first (ties: smaller token).
fn by_frequency(counts: &[(u32, u32)]) -> Vec<(u32, f64)> {
    let total: u32 = counts.iter().map(|c| c.1).sum();
    let mut sorted = counts.to_vec();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    sorted
        .into_iter()
        .map(|(t, c)| (t, f64::from(c) / f64::from(total)))
        .collect()
}

/// A draft tree of up to `max` nodes after `tokens`, grown best-first: `next(ctx)` gives
/// the continuations of a context (the last [`MAX_CONTEXT`] tokens up to a node) with
/// their shares; a candidate's score is its path's product of shares; the best candidate
/// (ties: the earliest found) joins while its score is at least [`MIN_PATH_PROB`].
fn grow(tokens: &[u32], max: usize, mut next: impl FnMut(&[u32]) -> Vec<(u32, f64)>) -> Draft {
    struct Candidate {
        score: f64,
        parent: i32,
        token: u32,
    }
    let mut draft = Draft::default();
    let root: Vec<u32> = tokens[tokens.len().saturating_sub(MAX_CONTEXT)..].to_vec();
    // Each node's context (the root's at ROOT + 1).
    let mut contexts = vec![root];
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut expand = |contexts: &[Vec<u32>], parent: i32, score: f64, out: &mut Vec<Candidate>| {
        for (token, share) in next(&contexts[(parent + 1) as usize]) {
            out.push(Candidate {
                score: score * share,
                parent,
                token,
            });
        }
    };
    expand(&contexts, ROOT, 1.0, &mut candidates);
    while draft.len() < max {
        let best = candidates.iter().enumerate().fold(
            None,
            |best: Option<(usize, f64)>, (i, c)| match best {
                Some((_, s)) if s >= c.score => best,
                _ => Some((i, c.score)),
            },
        );
        let Some((i, score)) = best.filter(|b| b.1 >= MIN_PATH_PROB) else {
            break;
        };
        let c = candidates.remove(i);
        let mut ctx = contexts[(c.parent + 1) as usize].clone();
        ctx.push(c.token);
        if ctx.len() > MAX_CONTEXT {
            ctx.remove(0);
        }
        contexts.push(ctx);
        draft.tokens.push(c.token);
        draft.parents.push(c.parent);
        expand(&contexts, draft.len() as i32 - 1, score, &mut candidates);
    }
    draft
}

/// Contexts (hashed) to what followed them.
type Table = HashMap<u64, Continuations>;

/// The keys of the contexts of 1 to [`MAX_CONTEXT`] tokens that end where `tokens` does,
/// shortest first.
fn context_keys(tokens: &[u32]) -> impl Iterator<Item = u64> + '_ {
    tokens
        .iter()
        .rev()
        .take(MAX_CONTEXT)
        .scan(0x51_7cc1_b727_220a_u64, |h, &t| {
            *h = (*h ^ (u64::from(t) + 1)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            Some(*h)
        })
}

/// Adds what followed each context for the tokens at `from..to`.
fn index(table: &mut Table, tokens: &[u32], from: usize, to: usize) {
    for p in from.max(1)..to {
        for key in context_keys(&tokens[..p]) {
            table.entry(key).or_default().add(tokens[p]);
        }
    }
}

fn table_bytes(table: &Table) -> usize {
    let entry = size_of::<u64>() + size_of::<Continuations>();
    table.capacity() * entry
}

/// One running request's table, and its output (for the global table when it ends).
#[derive(Debug, Default)]
struct RequestTables {
    table: Indexed<Table>,
    /// Its tokens from its first proposal on.
    output_from: usize,
    output: Vec<u32>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct SuffixDrafter {
    requests: HashMap<u64, RequestTables>,
    retained: Handoff<Table>,
    /// All requests' recent outputs: the newer generation and the older.
    global: [Table; 2],
}

impl SuffixDrafter {
    /// The continuations of the longest context of `ctx` known, the request's own table
    /// first at each length.
    fn next(&self, own: &Table, ctx: &[u32]) -> Vec<(u32, f64)> {
        let keys: Vec<u64> = context_keys(ctx).collect();
        let tables = [own, &self.global[0], &self.global[1]];
        keys.iter()
            .rev()
            .find_map(|k| tables.iter().find_map(|t| t.get(k)))
            .map_or(Vec::new(), Continuations::shares)
    }

    /// Bytes the tables take, about: running requests', retained ones' and the global.
    pub fn bytes(&self) -> usize {
        let own: usize = self
            .requests
            .values()
            .map(|r| table_bytes(&r.table.data))
            .sum();
        let kept: usize = self.retained.iter().map(|r| table_bytes(&r.data)).sum();
        own + kept + self.global.iter().map(table_bytes).sum::<usize>()
    }
}

impl Drafter for SuffixDrafter {
    fn propose(&mut self, id: u64, tokens: &[u32], max: usize) -> Draft {
        let len = tokens.len();
        let retained = &mut self.retained;
        let r = self.requests.entry(id).or_insert_with(|| RequestTables {
            table: retained.take(tokens).unwrap_or_default(),
            output_from: len.saturating_sub(1),
            output: Vec::new(),
        });
        if r.table.indexed > len {
            *r = RequestTables::default(); // not this request's tokens: start over
        }
        let from = r.table.indexed;
        index(&mut r.table.data, tokens, from, len);
        r.table.advance_to(tokens, len);
        r.output.extend(&tokens[from.max(r.output_from)..len]);
        let own = &self.requests[&id].table.data;
        grow(tokens, max, |ctx| self.next(own, ctx))
    }

    fn finished(&mut self, id: u64) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        if self.global[0].len() >= GLOBAL_CONTEXTS / 2 {
            self.global[1] = std::mem::take(&mut self.global[0]);
        }
        index(&mut self.global[0], &r.output, 0, r.output.len());
        let bytes = table_bytes(&r.table.data);
        self.retained.keep(r.table, bytes);
    }

    fn memory_bytes(&self) -> usize {
        self.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The drafter's proposal by brute force over `tokens` alone (no global table, every
    /// continuation counted): the oracle, exact while no context has more than
    /// [`BRANCHES`] distinct continuations.
    fn naive(tokens: &[u32], max: usize) -> Draft {
        grow(tokens, max, |ctx| {
            (1..=MAX_CONTEXT.min(ctx.len()))
                .rev()
                .map(|k| {
                    let suffix = &ctx[ctx.len() - k..];
                    let mut counts: Vec<(u32, u32)> = Vec::new();
                    for p in k..tokens.len() {
                        if &tokens[p - k..p] == suffix {
                            match counts.iter_mut().find(|c| c.0 == tokens[p]) {
                                Some(c) => c.1 += 1,
                                None => counts.push((tokens[p], 1)),
                            }
                        }
                    }
                    by_frequency(&counts)
                })
                .find(|c| !c.is_empty())
                .unwrap_or_default()
        })
    }

    proptest! {
        /// The incremental tables propose what the brute force finds, as a request grows
        /// by appends of any length, over alphabets of at most BRANCHES tokens.
        #[test]
        fn the_tables_propose_what_brute_force_finds(
            alphabet in 2u32..=BRANCHES as u32,
            seed_tokens in prop::collection::vec(0u32..1000, 1..40),
            appends in prop::collection::vec((1usize..6, 1usize..7), 1..30),
        ) {
            let mut tokens: Vec<u32> = seed_tokens.iter().map(|t| t % alphabet).collect();
            let mut d = SuffixDrafter::default();
            let mut next = 11u32;
            for (grow, max) in appends {
                for _ in 0..grow {
                    next = next.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    tokens.push((next >> 16) % alphabet);
                }
                prop_assert_eq!(d.propose(1, &tokens, max), naive(&tokens, max));
            }
        }
    }

    #[test]
    fn drafts_follow_the_most_frequent_path_while_it_is_likely() {
        let mut d = SuffixDrafter::default();
        // "1 2" went on as "3 4 5" three times and as "9" once.
        let tokens = [
            1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 9, 0, 1, 2, 3, 4, 5, 7, 1, 2,
        ];
        assert_eq!(d.propose(0, &tokens, 3), Draft::chain(vec![3, 4, 5]));
        // After "5": 0 twice, 7 once, so the path's share falls to 3/4 x 2/3 = 1/2 at
        // the fourth token; the branch to 9 (1/4) joins before the path falls under it.
        let long = d.propose(0, &tokens, 10);
        assert_eq!(&long.tokens[..4], &[3, 4, 5, 0]);
        assert_eq!(&long.parents[..4], &[ROOT, 0, 1, 2]);
        let nine = long
            .tokens
            .iter()
            .position(|&t| t == 9)
            .expect("the rarer branch");
        assert_eq!(long.parents[nine], ROOT);
        let seven = long
            .tokens
            .iter()
            .position(|&t| t == 7)
            .expect("after 5: 7");
        assert_eq!(long.parents[seven], 2);
        assert!(nine > 3 && seven > 3, "the likelier path first: {long:?}");
        // Nothing seen after the last token: no draft.
        assert!(d.propose(5, &[1, 2, 3, 4], 4).is_empty());
    }

    #[test]
    fn other_requests_outputs_draft_for_a_new_one() {
        let mut d = SuffixDrafter::default();
        let prompt = [50, 51, 52];
        let mut first: Vec<u32> = prompt.to_vec();
        first.push(7);
        d.propose(1, &first, 4);
        first.extend([8, 9, 10, 11]); // its output: 7 8 9 10 11
        d.propose(1, &first, 4);
        d.finished(1);
        // A request with another prompt that has just emitted 7 8: the global table
        // knows what followed.
        assert_eq!(
            d.propose(2, &[60, 61, 7, 8], 3),
            Draft::chain(vec![9, 10, 11])
        );
        assert!(d.bytes() > 0);
    }
}
