//! Speculative decoding in the scheduler: the same greedy tokens in fewer steps, the draft
//! policy, trees, and lossless sampled verification.
use super::*;

#[test]
fn greedy_speculation_gives_the_same_tokens_in_fewer_steps() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
    let drafters = [DrafterKind::Ngram, DrafterKind::Suffix];
    for ((model, predictable), drafter) in [(periodic as Model, true), (hashed, false)]
        .into_iter()
        .flat_map(|m| drafters.map(|d| (m, d)))
    {
        let (plain, _, m0) = run_all(cfg.clone(), 512, model, &prompts, 40);
        let mut cfg = speculative(cfg.clone(), 4);
        cfg.speculative = cfg.speculative.map(|s| SpecConfig { drafter, ..s });
        let (spec, usage, m1) = run_all(cfg, 512, model, &prompts, 40);
        assert_eq!(plain, spec, "speculation changed greedy tokens");
        assert!(m1.spec_drafted_tokens.get() > 0);
        // The accept-length histogram holds one observation per verify step with a
        // draft: the tokens it emitted, accepted drafts and the model's own.
        let lengths = &m1.spec_accept_length;
        assert!(lengths.count() > 0);
        let accepted = lengths.sum() - lengths.count() as f64;
        assert_eq!(accepted, m1.spec_accepted_tokens.get() as f64);
        if predictable {
            // Every draft of a repeating model is right: about 5 tokens a step.
            assert!(
                m1.steps.get() * 3 < m0.steps.get(),
                "{} vs {} steps",
                m1.steps.get(),
                m0.steps.get()
            );
            assert!(
                usage.iter().all(|u| u.spec_accepted_tokens >= 30),
                "{usage:?}"
            );
        }
    }
}

/// [`speculative`] with drafts sized by the measured policy.
fn measured(cfg: SchedulerConfig, max_draft: usize) -> SchedulerConfig {
    let mut cfg = speculative(cfg, max_draft);
    cfg.speculative = cfg.speculative.map(|s| SpecConfig {
        policy: crate::speculative::DraftPolicy::Measured,
        ..s
    });
    cfg
}

/// 10 ms a decode step, and 0.1 ms per drafted token (verification nearly free).
fn cheap((requests, rows): (usize, usize)) -> f64 {
    0.010 + 0.0001 * (rows - requests) as f64
}

/// 10 ms a decode step, and 1 ms per drafted token: drafts of high acceptance pay, of low
/// acceptance do not.
fn moderate((requests, rows): (usize, usize)) -> f64 {
    0.010 + 0.001 * (rows - requests) as f64
}

/// 10 ms a decode step, and 10 ms per request's worth of drafted tokens (verifying a
/// draft costs as much as the tokens it could save).
fn dear((requests, rows): (usize, usize)) -> f64 {
    0.010 * rows as f64 / requests as f64
}

/// With the overlapped schedule, speculation overlaps the steps where the policy drafts
/// nothing, as plain decoding does, and not the drafted ones (verifying and drafting need
/// the tokens); the tokens are plain decoding's either way.
#[test]
fn steps_the_policy_drafts_nothing_in_overlap_and_drafted_ones_do_not() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..4).map(periodic_prompt).collect();
    let (plain, _, m0) = run_all(cfg.clone(), 512, periodic, &prompts, 60);
    for (cost, drafts_pay) in [(dear as StepCost, false), (cheap, true)] {
        let mut run = Run::new(measured(cfg.clone(), 4), 512);
        run.kv.model = periodic;
        run.cost = Some(cost);
        run.overlap = true;
        let (got, _) = run.all(&prompts, 60);
        assert_eq!(got, plain, "drafts pay: {drafts_pay}");
        let (steps, fed) = (run.metrics.steps.get() as usize, run.fed_steps);
        let drafted = run.metrics.spec_drafted_tokens.get();
        match drafts_pay {
            // It drafts nearly all along (a plain step now and then, to measure it): few
            // steps, and most of them not overlapped.
            true => {
                assert!(steps * 2 < m0.steps.get() as usize, "{steps} steps");
                assert!(fed * 2 < steps, "{fed} of {steps} steps overlapped");
            }
            // It stops drafting after a try: then the steps overlap.
            false => {
                assert!(drafted <= 16, "{drafted} drafted");
                assert!(fed + 4 >= steps, "{fed} of {steps} steps overlapped");
            }
        }
    }
}

#[test]
fn the_measured_policy_drafts_only_where_verification_pays() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..4).map(periodic_prompt).collect();
    let (plain, _, m0) = run_all(cfg.clone(), 512, periodic, &prompts, 60);
    // Right drafts, cheap verification: it drafts, in far fewer steps.
    let (spec, _, m) = run_costed(
        measured(cfg.clone(), 4),
        512,
        periodic,
        &prompts,
        60,
        Some(cheap),
    );
    assert_eq!(plain, spec, "speculation changed greedy tokens");
    assert!(
        m.steps.get() * 2 < m0.steps.get(),
        "{} vs {}",
        m.steps.get(),
        m0.steps.get()
    );
    // Right drafts, dear verification: one step tries drafts (a size not yet measured),
    // then it stops.
    let (spec, _, m) = run_costed(
        measured(cfg.clone(), 4),
        512,
        periodic,
        &prompts,
        60,
        Some(dear),
    );
    assert_eq!(plain, spec);
    assert!(
        m.spec_drafted_tokens.get() <= 16,
        "{}",
        m.spec_drafted_tokens.get()
    );
    // The policy's decisions, counted by kind: a first step with nothing timed, probes of
    // the plain step, one try, then no gain.
    let decided = |d: PolicyDecision| m.spec_policy_steps[d as usize].get();
    assert!(decided(PolicyDecision::Unmeasured) + decided(PolicyDecision::Probe) >= 1);
    assert!(
        decided(PolicyDecision::Draft) <= 4,
        "{}",
        decided(PolicyDecision::Draft)
    );
    assert!(
        decided(PolicyDecision::NoGain) > 10,
        "{}",
        decided(PolicyDecision::NoGain)
    );
    // Wrong drafts, verification at 10% of a step per token: acceptance falls and
    // drafting stops, where the fixed policy drafts all along.
    let (plain, _, _) = run_all(cfg.clone(), 512, hashed, &prompts, 60);
    let (fixed, _, mf) = run_all(speculative(cfg.clone(), 4), 512, hashed, &prompts, 60);
    let (spec, _, m) = run_costed(measured(cfg, 4), 512, hashed, &prompts, 60, Some(moderate));
    assert_eq!(plain, fixed);
    assert_eq!(plain, spec);
    let (drafted, fixed_drafted) = (m.spec_drafted_tokens.get(), mf.spec_drafted_tokens.get());
    assert!(drafted * 4 < fixed_drafted, "{drafted} vs {fixed_drafted}");
}

#[test]
fn the_measured_policy_drafts_as_deep_as_drafts_are_accepted() {
    // Simulated acceptance at 4 keeps 3 of 5 drafted tokens, every step: once measured,
    // the policy drafts 3 (the 4th and 5th never pay) and each verify step still emits 4.
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let mut cfg = measured(cfg, 5);
    cfg.speculative = cfg.speculative.map(|s| SpecConfig {
        drafter: crate::speculative::DrafterKind::Simulated,
        simulated_accept_len: Some(4.0),
        ..s
    });
    let prompts: Vec<Vec<u32>> = (0..6).map(periodic_prompt).collect();
    let (_, _, m) = run_costed(cfg, 1024, hashed, &prompts, 400, Some(moderate));
    let lengths = &m.spec_accept_length;
    let verified = lengths.count() as f64;
    let drafted = m.spec_drafted_tokens.get() as f64 / verified;
    assert!(drafted < 3.3, "{drafted} drafted a verify step");
    assert!(
        lengths.sum() / verified > 3.8,
        "{}",
        lengths.sum() / verified
    );
}

#[test]
fn simulated_acceptance_emits_the_set_length_per_verify_step() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..6).map(periodic_prompt).collect();
    for len in [1.0, 2.5, 4.0] {
        let mut cfg = speculative(cfg.clone(), 4);
        cfg.speculative = cfg.speculative.map(|s| SpecConfig {
            drafter: crate::speculative::DrafterKind::Simulated,
            simulated_accept_len: Some(len),
            ..s
        });
        // The simulation, not the model, decides what a verify step keeps.
        let (out, usage, m) = run_all(cfg, 512, hashed, &prompts, 200);
        assert!(out.iter().all(|t| t.len() == 200), "max_tokens still holds");
        assert!(usage.iter().all(|u| u.completion_tokens == 200));
        let lengths = &m.spec_accept_length;
        let mean = lengths.sum() / lengths.count() as f64;
        assert!((mean - len).abs() < 0.1, "{len}: {mean}");
    }
}

#[test]
fn speculation_through_preemption_and_chunked_prefill_keeps_the_tokens() {
    let mut cfg = config(4, 24, 6);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..12)
        .map(|i| {
            let mut p = periodic_prompt(i);
            p.extend((0..i * 5).map(|t| 1 + (t * 7 + i) % 40));
            p
        })
        .collect();
    let (plain, _, _) = run_all(cfg.clone(), 4096, periodic, &prompts, 30);
    // A pool that holds about three requests: preemption with drafts in flight.
    let (spec, _, m) = run_all(speculative(cfg, 3), 48, periodic, &prompts, 30);
    assert_eq!(plain, spec);
    assert!(m.preemptions.get() > 0, "the pool was meant to preempt");
    assert!(m.spec_accepted_tokens.get() > 0);
}

#[test]
fn stop_tokens_and_max_tokens_inside_an_accepted_draft_end_it_there() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids = vec![5]; // the periodic prompt's fifth token
    let prompts = vec![periodic_prompt(0)];
    let (plain, pu, _) = run_all(cfg.clone(), 512, periodic, &prompts, 40);
    let (spec, su, _) = run_all(speculative(cfg.clone(), 4), 512, periodic, &prompts, 40);
    assert_eq!(plain, spec);
    assert_eq!(pu[0].completion_tokens, su[0].completion_tokens);
    assert!(!spec[0].contains(&5) && spec[0].len() < 40, "{spec:?}");
    cfg.eos_token_ids.clear();
    for max in [1, 2, 6, 9] {
        let (spec, _, _) = run_all(speculative(cfg.clone(), 4), 512, periodic, &prompts, max);
        assert_eq!(spec[0].len(), max);
    }
}

/// Drafts a tree that puts the periodic model's continuation behind a wrong sibling: the
/// root's children are (wrong, right), right's child is the next right token, the wrong
/// one has a child too. Verification takes the second child, so the accepted path's rows
/// are out of place and the next step rewrites them.
struct DecoyTree;

impl Drafter for DecoyTree {
    fn propose(&mut self, _id: u64, tokens: &[u32], max: usize) -> Draft {
        let n = tokens.len();
        if max < 4 || n < PERIOD {
            return Draft::default();
        }
        let wrong = |t: u32| 1 + t % (VOCAB as u32 - 1);
        let (right, next) = (tokens[n - PERIOD], tokens[n - PERIOD + 1]);
        Draft {
            tokens: vec![wrong(right), right, next, wrong(next)],
            parents: vec![ROOT, ROOT, 1, 0],
        }
    }
}

#[test]
fn a_tree_whose_accepted_path_is_out_of_place_gives_the_same_tokens() {
    let mut cfg = config(4, 256, 8);
    cfg.eos_token_ids.clear();
    let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
    let (plain, _, m0) = run_all(cfg.clone(), 512, periodic, &prompts, 40);
    let mut run = Run::new(speculative(cfg, 4), 512);
    run.kv.model = periodic;
    run.sched.drafter = Some(Box::new(DecoyTree));
    let mut rxs: Vec<_> = (0..prompts.len())
        .map(|i| run.submit(i as u64, prompts[i].clone(), 40))
        .collect();
    run.run_to_end();
    let spec: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| outcome(rx).0).collect();
    assert_eq!(plain, spec, "a tree changed greedy tokens");
    assert!(run.kv.trees > 0, "trees reached the model");
    assert!(run.device_steps > 0, "greedy steps read token ids back");
    // Two drafted tokens and the model's own a step.
    let m = &run.metrics;
    assert!(
        m.steps.get() * 2 < m0.steps.get(),
        "{} vs {}",
        m.steps.get(),
        m0.steps.get()
    );
    let lengths = &m.spec_accept_length;
    assert!(lengths.sum() / lengths.count() as f64 > 2.5);
}

/// Out-of-place accepted tokens leave several pending: their draft still fits the step's
/// token budget, however small it is.
#[test]
fn drafts_after_out_of_place_tokens_fit_a_small_step_budget() {
    for budget in [5, 6, 7, 9] {
        let mut cfg = config(4, budget, 4);
        cfg.eos_token_ids.clear();
        let prompts: Vec<Vec<u32>> = (0..5).map(periodic_prompt).collect();
        let (plain, _, _) = run_all(cfg.clone(), 512, periodic, &prompts, 30);
        let mut run = Run::new(speculative(cfg, 4), 512);
        run.kv.model = periodic;
        run.sched.drafter = Some(Box::new(DecoyTree));
        let mut rxs: Vec<_> = (0..prompts.len())
            .map(|i| run.submit(i as u64, prompts[i].clone(), 30))
            .collect();
        run.run_to_end();
        let spec: Vec<Vec<u32>> = rxs.iter_mut().map(|rx| outcome(rx).0).collect();
        assert_eq!(plain, spec, "budget {budget}");
        assert!(run.kv.trees > 0, "budget {budget}: trees reached the model");
    }
}

/// `P(tokens[pos] = t)` over the model's own sampling, computed exactly from the model.
fn exact_marginal(model: Model, prompt: &[u32], pos: usize) -> Vec<f64> {
    fn probs(model: Model, ctx: &[u32]) -> Vec<f64> {
        let l = model(ctx);
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = l.iter().map(|&x| (x as f64 - max).exp()).collect();
        let total: f64 = w.iter().sum();
        w.iter().map(|x| x / total).collect()
    }
    let mut paths = vec![(prompt.to_vec(), 1.0)];
    for _ in 0..pos {
        paths = paths
            .into_iter()
            .flat_map(|(ctx, p)| {
                probs(model, &ctx)
                    .into_iter()
                    .enumerate()
                    .map(move |(t, q)| {
                        let mut c = ctx.clone();
                        c.push(t as u32);
                        (c, p * q)
                    })
            })
            .filter(|(_, p)| *p > 1e-12)
            .collect();
    }
    let mut out = vec![0.0; VOCAB];
    for (ctx, p) in paths {
        for (t, q) in probs(model, &ctx).into_iter().enumerate() {
            out[t] += p * q;
        }
    }
    out
}

/// Sampled speculation is lossless: the third generated token (after two verified steps)
/// is distributed as the model's own sampling says, by a chi-square test at p = 0.001 over
/// 20,000 requests (tokens binned by id mod 11).
#[test]
fn sampled_speculation_emits_the_distribution_of_plain_sampling() {
    for tree in [false, true] {
        sampled_speculation_is_lossless(tree);
    }
}

/// Chains of the n-gram drafter, or [`DecoyTree`]'s trees (two children to verify at the
/// root).
fn sampled_speculation_is_lossless(tree: bool) {
    let mut cfg = speculative(config(4, 512, 16), 4);
    cfg.eos_token_ids.clear();
    let mut run = Run::new(cfg, 4096);
    run.kv.model = soft;
    if tree {
        run.sched.drafter = Some(Box::new(DecoyTree));
    }
    let prompt = periodic_prompt(0);
    let (trials, bins) = (20_000usize, 11usize);
    let mut counts = vec![0usize; bins];
    for round in 0..trials / 16 {
        let mut rxs: Vec<_> = (0..16)
            .map(|i| {
                let id = (round * 16 + i) as u64;
                let params = SamplingParams {
                    max_tokens: 3,
                    temperature: 1.0,
                    seed: id * 7919 + 1,
                    ..SamplingParams::default()
                };
                run.submit_params(id, prompt.clone(), params, ROOM)
            })
            .collect();
        run.run_to_end();
        for rx in &mut rxs {
            let tokens = outcome(rx).0;
            counts[tokens[2] as usize % bins] += 1;
        }
    }
    assert!(
        run.metrics.spec_accepted_tokens.get() > 1000,
        "drafts were verified"
    );
    assert!(
        run.metrics.spec_accepted_tokens.get() < run.metrics.spec_drafted_tokens.get(),
        "and some rejected"
    );
    let exact = exact_marginal(soft, &prompt, 2);
    let mut want = vec![0.0; bins];
    for (t, p) in exact.iter().enumerate() {
        want[t % bins] += p;
    }
    let fit = kiln_reference::stats::chi_square(&counts, &want);
    assert!(
        fit.statistic < kiln_reference::stats::critical_value_p001(fit.dof),
        "tree {tree}: {counts:?} vs {want:?}: {fit:?}"
    );
    assert_eq!(run.kv.trees > 0, tree);
    assert!(run.logit_steps > 0, "sampled drafts read logits back");
}
