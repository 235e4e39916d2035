//! Constrained decoding as the scheduler sees it: a request may carry a [`Constraint`]
//! (a grammar's matcher, [`crate::server`] builds them from JSON schemas) that says which
//! tokens may come next. A step that samples such a request's next token sends the allowed
//! set as a bitset with its row ([`Batch::masks`](crate::model::gpu::Batch::masks)): the
//! device draws from the row with the forbidden tokens at minus infinity. A request that
//! drafts has its rows come back as logits instead: its drafts are verified node by node
//! against the masked rows along the accepted path (the matcher moves past each accepted
//! token), so speculation keeps the constrained distribution.
use std::fmt::Debug;

/// The tokens that may come next.
#[derive(Clone, Debug, PartialEq)]
pub struct Allowed {
    /// Bit `t % 32` of word `t / 32` is set when token `t` may come next; tokens past
    /// the words may not.
    pub words: Vec<u32>,
    /// Whether the output may end here: its stop tokens (end-of-sequence, the turn's end)
    /// may come next exactly when this holds.
    pub may_end: bool,
}

impl Allowed {
    pub fn allows(&self, token: u32) -> bool {
        let (w, b) = (token as usize / 32, token % 32);
        self.words.get(w).is_some_and(|&word| word >> b & 1 == 1)
    }

    /// The allowed tokens as a bitset (bit `t % 32` of word `t / 32`; tokens past the
    /// words are not allowed): the tokens [`Self::allows`], except that `stops` (the
    /// tokens that end the output) are allowed exactly when the output may end.
    pub fn bits(&self, stops: &[u32]) -> Vec<u32> {
        let mut words = self.words.clone();
        for &t in stops {
            let (w, b) = (t as usize / 32, t % 32);
            if w >= words.len() {
                words.resize(w + 1, 0);
            }
            words[w] = (words[w] & !(1 << b)) | (u32::from(self.may_end) << b);
        }
        words
    }

    /// `logits` with every forbidden token ([`Self::bits`]) at minus infinity.
    pub fn mask(&self, logits: &[f32], stops: &[u32]) -> Vec<f32> {
        kiln_core::sampling::masked(logits, &self.bits(stops))
    }
}

/// What a request's output must match, followed token by token.
pub trait Constraint: Send + Debug {
    /// The tokens that may come next; `Err` when the constraint cannot go on.
    fn allowed(&mut self) -> Result<Allowed, String>;
    /// Moves past `token`, one [`Self::allowed`] allowed.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// Whether nothing more may follow (the output is complete).
    fn is_complete(&self) -> bool;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_keeps_allowed_tokens_and_stops_only_where_the_output_may_end() {
        let allowed = Allowed {
            words: vec![0b1010, 1 << 1], // tokens 1, 3 and 33
            may_end: false,
        };
        let logits: Vec<f32> = (0..40).map(|t| t as f32).collect();
        let stop = [39];
        let kept: Vec<usize> = (allowed.mask(&logits, &stop).iter().enumerate())
            .filter(|(_, l)| l.is_finite())
            .map(|(t, _)| t)
            .collect();
        assert_eq!(kept, vec![1, 3, 33]);
        let ending = Allowed {
            may_end: true,
            ..allowed
        };
        assert!(ending.mask(&logits, &stop)[39].is_finite());
        // As a bitset: the stop token's bit set where the output may end, clear elsewhere.
        assert_eq!(ending.bits(&stop), vec![0b1010, 1 << 1 | 1 << 7]);
        let mut stop_allowed = ending.clone();
        stop_allowed.may_end = false;
        stop_allowed.words = vec![0, u32::MAX];
        assert_eq!(stop_allowed.bits(&[39, 70]), vec![0, !(1 << 7), 0]);
    }
}
