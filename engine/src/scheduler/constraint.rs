//! Constrained decoding as the scheduler sees it: a request may carry a [`Constraint`]
//! (a grammar's matcher, [`crate::server`] builds them from JSON schemas) that says which
//! tokens may come next. Such a request's rows come back as logits, the forbidden tokens
//! are masked out and the row is sampled on the host as usual; its drafts are verified
//! node by node against the masked rows along the accepted path (the matcher moves past
//! each accepted token), so speculation keeps the constrained distribution.
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

    /// `logits` with every forbidden token at minus infinity; `is_stop` names the tokens
    /// that end the output.
    pub fn mask(&self, logits: &[f32], is_stop: impl Fn(u32) -> bool) -> Vec<f32> {
        (logits.iter().enumerate())
            .map(|(t, &l)| {
                let t = t as u32;
                let ok = if is_stop(t) {
                    self.may_end
                } else {
                    self.allows(t)
                };
                if ok {
                    l
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect()
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
        let stop = |t: u32| t == 39;
        let kept: Vec<usize> = (allowed.mask(&logits, stop).iter().enumerate())
            .filter(|(_, l)| l.is_finite())
            .map(|(t, _)| t)
            .collect();
        assert_eq!(kept, vec![1, 3, 33]);
        let ending = Allowed {
            may_end: true,
            ..allowed
        };
        assert!(ending.mask(&logits, stop)[39].is_finite());
    }
}
