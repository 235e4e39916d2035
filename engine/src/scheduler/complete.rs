//! Completing a step: its scores (rows of logits, or tokens drawn on the device) turned
//! into each request's tokens (verifying drafts first), events and retirements.
use std::time::Instant;

use kiln_core::rng::Rng;
use kiln_core::sampling::SamplingRow;

use kiln_kernels::sample::NO_TOKEN;

use super::constraint::Allowed;
use super::*;
use crate::sampling::{logprobs, sample, verify};

/// What a step returns for each row that gets logits.
#[derive(Clone, Copy, Debug)]
pub enum Scores<'a> {
    /// The rows of logits, `vocab` wide.
    Logits(&'a [f32], usize),
    /// Each row's token as drawn on the device ([`Batch::sampling`]): the argmax of a
    /// greedy request's rows, the draw of a sampled request's one row; and their
    /// log-probabilities when the step computed them ([`Batch::logprobs`]).
    Tokens(&'a [u32], Option<Logprobs<'a>>),
}

/// Rows' log-probabilities as the device computed them: each row's token's, and `top`
/// alternatives a row (`NO_TOKEN` past its numbers).
#[derive(Clone, Copy, Debug)]
pub struct Logprobs<'a> {
    pub token: &'a [f32],
    pub top: usize,
    pub ids: &'a [u32],
    pub values: &'a [f32],
}

impl<'a> Logprobs<'a> {
    fn rows(self, first: usize, n: usize) -> Self {
        let (a, b) = (first * self.top, (first + n) * self.top);
        Logprobs {
            token: &self.token[first..first + n],
            ids: &self.ids[a..b],
            values: &self.values[a..b],
            ..self
        }
    }
}

impl<'a> Scores<'a> {
    /// Rows `first..first + n`.
    fn rows(self, first: usize, n: usize) -> Scores<'a> {
        match self {
            Scores::Logits(l, vocab) => {
                Scores::Logits(&l[first * vocab..(first + n) * vocab], vocab)
            }
            Scores::Tokens(ids, lp) => {
                Scores::Tokens(&ids[first..first + n], lp.map(|l| l.rows(first, n)))
            }
        }
    }

    /// Row `i`.
    fn row(self, i: usize) -> Scores<'a> {
        self.rows(i, 1)
    }

    /// The next token from this one row, drawn as `row` says (the device drew it so).
    fn sample(self, row: &SamplingRow) -> u32 {
        match self {
            Scores::Logits(logits, _) => sample(logits, row),
            Scores::Tokens(ids, _) => ids[0],
        }
    }

    /// `token`'s log-probabilities at this one row ([`logprobs`]), with the `top` most likely.
    fn logprobs(self, token: u32, top: usize) -> TokenLogprobs {
        match self {
            Scores::Logits(logits, _) => logprobs(logits, token, top),
            Scores::Tokens(ids, Some(lp)) => {
                assert_eq!(
                    ids[0], token,
                    "a device row's log-probabilities are its token's"
                );
                let listed = (lp.ids.iter().zip(lp.values).take(top.min(lp.top)))
                    .filter(|(&id, _)| id != NO_TOKEN)
                    .map(|(&id, &v)| (id, v));
                TokenLogprobs {
                    logprob: lp.token[0],
                    top: listed.collect(),
                }
            }
            Scores::Tokens(_, None) => panic!("log-probabilities asked of a step without them"),
        }
    }

    /// [`verify`] of a node's children against this one row.
    fn verify(self, children: &[u32], row: &SamplingRow, rng: &mut Rng) -> Result<usize, u32> {
        match self {
            Scores::Logits(logits, _) => verify(logits, children, row, rng),
            Scores::Tokens(ids, _) => {
                assert!(
                    !row.is_sampled(),
                    "a sampled request's draft verified without its logits"
                );
                children.iter().position(|&c| c == ids[0]).ok_or(ids[0])
            }
        }
    }
}

/// Whether `token` ends request `r`'s output (`eos`: the model's end-of-sequence ids).
fn is_stop(r: &Request, eos: &[u32], token: u32) -> bool {
    (!r.params.ignore_eos && eos.contains(&token)) || r.params.stop_token_ids.contains(&token)
}

/// The tokens that end request `r`'s output.
pub(super) fn stops(r: &Request, eos: &[u32]) -> Vec<u32> {
    let eos = eos.iter().filter(|_| !r.params.ignore_eos);
    eos.chain(&r.params.stop_token_ids).copied().collect()
}

/// What request `r`'s constraint allows next (`None` without one). A constraint that
/// fails is logged and dropped: the output goes on unconstrained.
pub(super) fn allowed(r: &mut Request) -> Option<Allowed> {
    match r.constraint.as_mut()?.allowed() {
        Ok(allowed) => Some(allowed),
        Err(e) => {
            tracing::warn!(id = r.id, error = %e, "the output's constraint failed: dropped");
            r.constraint = None;
            None
        }
    }
}

/// Request `r`'s row of logits with the tokens its constraint forbids next at minus
/// infinity (`None` without a constraint, or for a row drawn on the device, which the
/// device masked: [`Batch::masks`]).
fn constrained(r: &mut Request, row: Scores, eos: &[u32]) -> Option<Vec<f32>> {
    let Scores::Logits(logits, _) = row else {
        return None;
    };
    allowed(r).map(|a| a.mask(logits, &stops(r, eos)))
}

/// Moves request `r`'s constraint past `token` (not past a token that ends the output);
/// whether the constrained output is now complete.
fn follow(r: &mut Request, eos: &[u32], token: u32) -> bool {
    if is_stop(r, eos, token) {
        return false;
    }
    let Some(c) = r.constraint.as_mut() else {
        return false;
    };
    if let Err(e) = c.accept(token) {
        tracing::warn!(id = r.id, error = %e, "the output's constraint failed: dropped");
        r.constraint = None;
        return false;
    }
    c.is_complete()
}

impl Scheduler {
    /// Takes the scores of `step` (a row per slice, plus one per drafted token):
    /// advances each request (unless [`Self::advance`] did), samples where a request's
    /// pending tokens are all computed (verifying its draft first: the accepted path, then
    /// one token of the model's own), sends its events and retires finished requests.
    /// An advanced step's requests that left meanwhile, or were preempted, are skipped.
    pub fn complete(&mut self, step: Step, scores: Scores) {
        let rows: usize = step.slices.iter().map(|s| 1 + s.draft.len()).sum();
        match scores {
            Scores::Logits(logits, vocab) => assert_eq!(logits.len(), rows * vocab),
            Scores::Tokens(ids, _) => assert_eq!(ids.len(), rows),
        }
        self.metrics.steps.add(1);
        let now = Instant::now();
        let mut finished = Vec::new();
        let mut row = 0;
        for (i, slice) in step.slices.iter().enumerate() {
            let rows = scores.rows(row, 1 + slice.draft.len());
            row += 1 + slice.draft.len();
            let idx = self.running.iter().position(|r| r.id == slice.id);
            let r = match (idx, step.advanced) {
                (Some(idx), _) => &mut self.running[idx],
                (None, true) => continue,
                (None, false) => panic!("a planned request is running"),
            };
            let mid_prefill = match step.advanced {
                // (or preempted since, and back with no token in flight)
                true => r.unresolved != Some(i),
                false => {
                    r.computed += slice.tokens;
                    r.pending() > 0
                }
            };
            if mid_prefill {
                // No token yet. The chunk's whole pages are shared at once, with requests
                // that arrive with the same prefix and those that wait for it (`admit`).
                cache_computed(&mut *self.cache, &mut self.pool, self.cfg.page_size, r);
                continue;
            }
            if step.advanced {
                r.unresolved = None;
                r.tokens.pop();
            }
            let prompt_done = slice.prompt_done;
            match r.last_token_at {
                None => self.metrics.ttft.observe(now - r.arrived),
                Some(t) => self.metrics.itl.observe(now - t),
            }
            r.last_token_at = Some(now);
            // The draft's accepted path from the root, then the model's own token where
            // it ends; in simulated-acceptance mode the path (first children) is drawn,
            // not checked.
            let draft = &slice.draft;
            let eos = &self.cfg.eos_token_ids;
            let simulated = self.cfg.speculative.and_then(|s| s.simulated_accept_len);
            let kept = simulated.map(|l| simulated_accepts(l, draft.max_depth(), r.rng.uniform()));
            let (mut path, mut emitted) = (Vec::new(), Vec::new());
            // Each emitted token's log-probabilities, from the row it was chosen at.
            let mut reported = Vec::new();
            let mut node = ROOT;
            loop {
                let raw = rows.row((node + 1) as usize);
                // A constrained request's drafts are verified against its masked rows:
                // the distribution it samples from.
                let masked = constrained(r, raw, eos);
                let row = masked
                    .as_deref()
                    .map_or(raw, |m| Scores::Logits(m, m.len()));
                let children: Vec<usize> = draft.children(node).collect();
                let tokens: Vec<u32> = children.iter().map(|&c| draft.tokens[c]).collect();
                let params = r.sampling_row(r.tokens.len() + emitted.len());
                let chosen = match kept {
                    Some(k) if path.len() < k && !children.is_empty() => Ok(0),
                    Some(_) => Err(row.sample(&params)),
                    None if children.is_empty() => Err(row.sample(&params)),
                    None => row.verify(&tokens, &params, &mut r.rng),
                };
                let token = match chosen {
                    Ok(k) => tokens[k],
                    Err(t) => t,
                };
                emitted.push(token);
                reported.push(
                    r.params
                        .logprobs
                        .map(|top| Box::new(raw.logprobs(token, top))),
                );
                let complete = follow(r, eos, token);
                match chosen {
                    Ok(k) => {
                        path.push(children[k]);
                        node = children[k] as i32;
                    }
                    Err(_) => break,
                }
                if complete {
                    break; // the constrained output is whole: nothing may follow
                }
            }
            let accepted = path.len();
            // Accepted nodes whose rows were written where their tokens belong.
            let in_place = path
                .iter()
                .enumerate()
                .take_while(|&(j, &n)| j == n)
                .count();
            // Every decode step counts as a verification (SGLang's `spec_verify_ct`, so
            // completion tokens over it is the accept length), an empty draft too.
            if self.drafter.is_some() && r.generated() > 0 {
                r.spec_verify_ct += 1;
            }
            if !slice.draft.is_empty() {
                r.spec_accepted += accepted;
                self.metrics
                    .spec_drafted_tokens
                    .add(slice.draft.len() as u64);
                self.metrics.spec_accepted_tokens.add(accepted as u64);
                self.metrics
                    .spec_accept_length
                    .observe_value((accepted + 1) as f64);
                r.acceptance.record(slice.draft.max_depth(), accepted);
                self.acceptance.record(slice.draft.max_depth(), accepted);
                if let Some(d) = self.drafter.as_mut() {
                    d.accepted(slice.id, slice.draft.len(), accepted);
                }
            }
            let mut reason = None;
            for (token, logprobs) in emitted.into_iter().zip(reported) {
                if is_stop(r, eos, token) {
                    reason = Some(FinishReason::Stop);
                    break;
                }
                r.tokens.push(token);
                self.metrics.generation_tokens.add(1);
                r.send(Event::Token(token, logprobs));
                if r.generated() >= r.params.max_tokens || r.tokens.len() >= self.cfg.context_len {
                    reason = Some(FinishReason::Length);
                    break;
                }
            }
            if r.constraint.as_ref().is_some_and(|c| c.is_complete()) {
                reason = reason.or(Some(FinishReason::Stop));
            }
            // KV is in place for the request's own tokens and the accepted path's leading
            // `0, 1, 2, ..` nodes; the next step rewrites the rest.
            r.computed = (r.computed + in_place).min(r.tokens.len());
            match reason {
                Some(reason) => finished.push((slice.id, reason)),
                None if prompt_done => {
                    // Share the prompt with requests that arrive while this one decodes.
                    let r = &mut self.running[idx.expect("found above")];
                    cache_computed(&mut *self.cache, &mut self.pool, self.cfg.page_size, r);
                }
                None => {}
            }
        }
        // Pages and gauges first, then the news: a client that has its answer sees the
        // server's metrics without its request.
        let mut done = Vec::with_capacity(finished.len());
        for (id, reason) in finished {
            let idx = self.running.iter().position(|r| r.id == id);
            let r = self
                .running
                .remove(idx.expect("finished requests are running"));
            let (usage, events) = (r.usage(), r.events.clone());
            tracing::debug!(id, reason = reason.as_str(), ?usage, "finished");
            self.retire(r);
            done.push((events, Event::Finished { reason, usage }));
        }
        self.metrics.requests_finished.add(done.len() as u64);
        self.publish();
        for (events, finished) in done {
            // Room: the request ran this step only with a slot kept for its end.
            let _ = events.try_send(finished);
        }
    }

    /// Fails every request of `step` (the device step failed) and frees their pages.
    pub fn fail(&mut self, step: Step, why: &str) {
        for Slice { id, .. } in step.slices {
            if let Some(idx) = self.running.iter().position(|r| r.id == id) {
                let r = self.running.remove(idx);
                r.send(Event::Failed(why.to_string()));
                if let Some(d) = self.drafter.as_mut() {
                    d.finished(r.id);
                }
                self.pool.release(&r.pages);
            }
        }
        self.publish();
    }
}
