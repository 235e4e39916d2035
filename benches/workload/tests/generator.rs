//! Properties of the session generator: prefix growth, distributions, the full-scale
//! shape, determinism (with a snapshot of a small workload).
use kiln_workload::{Dist, Session, SessionGenerator, TurnKind, WorkloadParams};
use proptest::prelude::*;

/// Asserts the sample mean of `xs` is within 5 standard errors of `d`'s exact mean, the
/// error from `d`'s exact variance (a heavy-tailed sample underestimates its own), plus
/// `slack` for rounding to whole tokens.
fn assert_mean_close(name: &str, xs: &[f64], d: &Dist, slack: f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let se = (d.variance() / n).sqrt();
    assert!(
        (mean - d.mean()).abs() <= 5.0 * se + slack,
        "{name}: sample mean {mean} vs expected {} (se {se}, n {n})",
        d.mean()
    );
}

/// Asserts the share of ones in `xs` is within 5 binomial standard errors of `p`.
fn assert_share_close(name: &str, xs: &[f64], p: f64) {
    let n = xs.len() as f64;
    let share = xs.iter().sum::<f64>() / n;
    let se = (p * (1.0 - p) / n).sqrt();
    assert!(
        (share - p).abs() <= 5.0 * se + 1.0 / n,
        "{name}: share {share} vs expected {p} (n {n})"
    );
}

fn arb_dist(mean: std::ops::Range<f64>) -> impl Strategy<Value = Dist> {
    (mean, 0.0..1.5f64, 0.0..0.9f64, 2.0..20.0f64)
        .prop_map(|(m, s, lo, hi)| Dist::log_normal(m, s, (m * lo).max(1.0), m * hi))
}

fn arb_params() -> impl Strategy<Value = WorkloadParams> {
    (
        arb_dist(2.0..200.0),
        arb_dist(2.0..200.0),
        arb_dist(1.0..50.0),
        arb_dist(1.0..30.0),
        0.0..1.0f64,
        0.0..1.0f64,
        0.0..1.0f64,
        (2u32..5, 0u32..4),
    )
        .prop_map(
            |(tool, user, output, turns, user_share, tree, fork, (lo, extra))| WorkloadParams {
                system_prompt_tokens: 40,
                tool_result: tool,
                user_message: user,
                output,
                turns,
                user_turn_share: user_share,
                tree_session_share: tree,
                fork_probability: fork,
                fanout_min: lo,
                fanout_max: lo + extra,
                max_context: u32::MAX,
                ..WorkloadParams::default().scaled(0.01)
            },
        )
}

/// Every (turn, branch) of a session.
fn requests(s: &Session) -> impl Iterator<Item = (usize, usize)> + '_ {
    s.turns
        .iter()
        .enumerate()
        .flat_map(|(t, turn)| (0..turn.requests.len()).map(move |b| (t, b)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_turn_extends_the_previous_input_plus_output(
        scale in 0.001..0.03f64, seed: u64, index in 0u64..1000,
    ) {
        let g = SessionGenerator::new(WorkloadParams::default().scaled(scale), seed).unwrap();
        let s = g.session(index);
        prop_assert!(!s.turns.is_empty());
        prop_assert!(s.input_ids(0, 0).starts_with(&s.system_prompt_ids()));
        for (t, b) in requests(&s) {
            let ids = s.input_ids(t, b);
            prop_assert_eq!(ids.len() as u64, s.input_len(t, b));
            let out = s.turns[t].requests[b].output as u64;
            prop_assert!(s.input_len(t, b) + out <= g.params().max_context as u64);
            if t > 0 {
                let mut prefix = s.input_ids(t - 1, 0);
                prefix.extend(s.output_ids(t - 1, 0));
                prop_assert!(ids.starts_with(&prefix), "turn {} branch {}", t, b);
                prop_assert_eq!(&ids[prefix.len()..], &s.new_input_ids(t, b)[..]);
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_sessions(params in arb_params(), seed: u64) {
        let a = SessionGenerator::new(params.clone(), seed).unwrap();
        let b = SessionGenerator::new(params, seed).unwrap();
        prop_assert_eq!(a.sessions(20), b.sessions(20));
        prop_assert_eq!(a.session(7).input_ids(0, 0), b.session(7).input_ids(0, 0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn sizes_gaps_and_shares_match_their_parameters(params in arb_params(), seed: u64) {
        let g = SessionGenerator::new(params.clone(), seed).unwrap();
        let sessions = g.sessions(400);
        let p = &params;
        let turns: Vec<f64> = sessions.iter().map(|s| s.turns.len() as f64).collect();
        assert_mean_close("turns", &turns, &p.turns, 0.5);
        let trees: Vec<f64> = sessions.iter().map(|s| s.tree as u8 as f64).collect();
        assert_share_close("tree share", &trees, p.tree_session_share);

        let (mut tool, mut user, mut output, mut is_user) = (vec![], vec![], vec![], vec![]);
        let (mut tool_gap, mut user_gap, mut fanout) = (vec![], vec![], vec![]);
        for s in sessions.iter() {
            for turn in s.turns.iter().skip(1) {
                let sizes = turn.requests.iter().map(|r| r.new_input as f64);
                let user_turn = turn.kind == TurnKind::UserMessage;
                is_user.push(user_turn as u8 as f64);
                if user_turn {
                    user.extend(sizes);
                    user_gap.push(turn.think_s);
                } else {
                    tool.extend(sizes);
                    tool_gap.push(turn.think_s);
                }
                if s.tree {
                    fanout.push((turn.requests.len() > 1) as u8 as f64);
                }
            }
            output.extend(s.turns.iter().flat_map(|t| t.requests.iter().map(|r| r.output as f64)));
        }
        assert_mean_close("output", &output, &p.output, 0.5);
        // Sessions of one turn have no follow-up turn to be a user or tool turn.
        if is_user.len() > 30 {
            assert_share_close("user share", &is_user, p.user_turn_share);
        }
        if tool.len() > 30 {
            assert_mean_close("tool result", &tool, &p.tool_result, 0.5);
            assert_mean_close("tool gap", &tool_gap, &p.tool_think_s, 0.0);
        }
        if user.len() > 30 {
            assert_mean_close("user message", &user, &p.user_message, 0.5);
            assert_mean_close("user gap", &user_gap, &p.user_think_s, 0.0);
        }
        if fanout.len() > 30 {
            assert_share_close("fork probability", &fanout, p.fork_probability);
        }
    }
}

#[test]
fn the_full_scale_workload_is_about_100k_in_and_500_out_per_request() {
    let g = SessionGenerator::new(WorkloadParams::default(), 1).unwrap();
    let (mut input, mut output, mut n) = (0u64, 0u64, 0u64);
    for s in g.sessions(3000) {
        for (t, b) in requests(&s) {
            input += s.input_len(t, b);
            output += s.turns[t].requests[b].output as u64;
            n += 1;
        }
    }
    let (mean_in, mean_out) = (input as f64 / n as f64, output as f64 / n as f64);
    assert!((85e3..115e3).contains(&mean_in), "mean input {mean_in}");
    assert!((450.0..550.0).contains(&mean_out), "mean output {mean_out}");
    let ratio = mean_in / mean_out;
    assert!((170.0..230.0).contains(&ratio), "input:output {ratio}");
}

#[test]
fn scaling_shrinks_every_context_by_the_factor() {
    let full = SessionGenerator::new(WorkloadParams::default(), 3).unwrap();
    let small = SessionGenerator::new(WorkloadParams::default().scaled(0.01), 3).unwrap();
    let mean_input = |g: &SessionGenerator| {
        let sessions = g.sessions(1000);
        let lens: Vec<f64> = sessions
            .iter()
            .flat_map(|s| requests(s).map(move |(t, b)| s.input_len(t, b) as f64))
            .collect();
        lens.iter().sum::<f64>() / lens.len() as f64
    };
    let ratio = mean_input(&small) / mean_input(&full);
    assert!((0.008..0.012).contains(&ratio), "scaled/full input {ratio}");
    assert_eq!(small.params().max_context, 2560);
}

#[test]
fn zero_think_scale_sends_turns_back_to_back() {
    let p = WorkloadParams::default().think_scaled(0.0);
    let g = SessionGenerator::new(p, 5).unwrap();
    assert!(g
        .sessions(50)
        .iter()
        .all(|s| s.turns.iter().all(|t| t.think_s == 0.0)));
}

#[test]
fn a_system_prompt_larger_than_the_context_is_rejected() {
    let p = WorkloadParams {
        max_context: 100,
        system_prompt_tokens: 100,
        ..WorkloadParams::default()
    };
    let err = SessionGenerator::new(p, 0).unwrap_err().to_string();
    assert!(err.contains("max_context"), "{err}");
}

/// One line per turn: kind, think time, and each request's new input and output.
fn render(s: &Session) -> String {
    let mut out = format!(
        "session {} tree={} system={}\n",
        s.id(),
        s.tree,
        s.system_prompt_tokens
    );
    for (t, turn) in s.turns.iter().enumerate() {
        let reqs: Vec<String> = turn
            .requests
            .iter()
            .map(|r| format!("+{}>{}", r.new_input, r.output))
            .collect();
        out += &format!(
            "  {t:2} {:?} wait {:.3}s in {} {}\n",
            turn.kind,
            turn.think_s,
            s.input_len(t, 0),
            reqs.join(" ")
        );
    }
    let first = s.new_input_ids(0, 0);
    out += &format!("  first message ids {:?}\n", &first[..first.len().min(8)]);
    out
}

#[test]
fn a_small_seeded_workload_is_stable() {
    let p = WorkloadParams {
        tree_session_share: 0.5,
        fork_probability: 0.5,
        turns: Dist::log_normal(5.0, 0.5, 2.0, 8.0),
        ..WorkloadParams::default().scaled(0.01)
    };
    let g = SessionGenerator::new(p, 42).unwrap();
    let text: String = g.sessions(3).iter().map(render).collect();
    insta::assert_snapshot!(text);
}
