//! DeepSeek-V3 / Kimi-K2 MoE router ("noaux_tc"): sigmoid scores, bias-corrected
//! group-limited top-k selection, unbiased normalized combine weights. In f64.
//!
//! Per token: `score = sigmoid(logit)`; `choice = score + e_score_correction_bias`;
//! experts are split into `n_group` equal groups, each group scored by the sum of its
//! two largest choices; the `topk_group` best groups are kept and the others' choices
//! masked to `-inf`; the `num_experts_per_tok` largest masked choices are selected.
//! The bias only steers selection: the weights are the unbiased scores of the
//! selected experts, divided by `(sum + 1e-20)` when `norm_topk_prob`, times
//! `routed_scaling_factor`.
//!
//! Invariants: experts are listed per token in selection order (descending choice,
//! ties to the lowest index), groups are ranked the same way, and no expert repeats.
//!
//! Follows HF transformers' `DeepseekV3TopkRouter` and DeepSeek-V3's
//! `inference/model.py` `Gate`. Masked experts get `-inf`, as in the original code,
//! SGLang and transformers 5.x (checked in the 5.17 and 5.24 sources:
//! `masked_fill(~score_mask, -inf)`); some transformers 4.x releases filled `0.0`
//! instead, which differs only when fewer than `num_experts_per_tok` experts of the
//! kept groups have a positive choice (possible only with negative biases): such a
//! router could select an expert from a dropped group. The peers compute in f32, so
//! selections may differ where two choices are within f32 rounding: see
//! [`selection_margins`].

/// Router hyper-parameters, named as in the HF config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateConfig {
    /// Number of routed experts (E).
    pub n_routed_experts: usize,
    /// Experts selected per token (top-k).
    pub num_experts_per_tok: usize,
    /// Number of expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Whether the selected weights are renormalized to sum to 1.
    pub norm_topk_prob: bool,
    /// Multiplier applied to the combine weights.
    pub routed_scaling_factor: f64,
}

impl GateConfig {
    /// Kimi K2.x: 384 experts, top-8, one group.
    pub fn kimi_k2() -> Self {
        Self {
            n_routed_experts: 384,
            num_experts_per_tok: 8,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.827,
        }
    }

    /// DeepSeek-V3: 256 experts, top-8, 8 groups of which 4 are kept.
    pub fn deepseek_v3() -> Self {
        Self {
            n_routed_experts: 256,
            num_experts_per_tok: 8,
            n_group: 8,
            topk_group: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        }
    }

    fn check(&self) {
        let (e, g) = (self.n_routed_experts, self.n_group);
        assert!(
            g > 0 && e % g == 0,
            "{e} experts do not split into {g} groups"
        );
        assert!(
            e / g >= 2,
            "groups need at least 2 experts (group score is a top-2 sum)"
        );
        assert!(
            self.topk_group >= 1 && self.topk_group <= g,
            "topk_group out of range"
        );
        let kept = self.topk_group * e / g;
        assert!(
            self.num_experts_per_tok <= kept,
            "top-k exceeds the experts of kept groups"
        );
    }
}

/// The router's decision for a batch of tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[tokens, top_k]` selected expert ids, per token in selection order.
    pub experts: Vec<usize>,
    /// `[tokens, top_k]` combine weights, aligned with `experts`.
    pub weights: Vec<f64>,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of `values` sorted by descending value, ties by ascending index.
fn ranked(values: &[f64]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx
}

/// One token's scores, group-masked choices and group scores.
struct TokenChoice {
    scores: Vec<f64>,
    masked: Vec<f64>,
    group_scores: Vec<f64>,
}

fn token_choice<T: Copy + Into<f64>>(logits: &[T], bias: &[f32], cfg: &GateConfig) -> TokenChoice {
    let scores: Vec<f64> = logits.iter().map(|&l| sigmoid(l.into())).collect();
    let choice: Vec<f64> = scores
        .iter()
        .zip(bias)
        .map(|(s, &b)| s + b as f64)
        .collect();
    let group_size = cfg.n_routed_experts / cfg.n_group;
    let group_scores: Vec<f64> = choice
        .chunks(group_size)
        .map(|g| {
            let top = ranked(g);
            g[top[0]] + g[top[1]]
        })
        .collect();
    let mut masked = vec![f64::NEG_INFINITY; choice.len()];
    for &g in &ranked(&group_scores)[..cfg.topk_group] {
        let span = g * group_size..(g + 1) * group_size;
        masked[span.clone()].copy_from_slice(&choice[span]);
    }
    TokenChoice {
        scores,
        masked,
        group_scores,
    }
}

/// Routes each token of `logits` (`[tokens, n_routed_experts]`) given the
/// `e_score_correction_bias` (`[n_routed_experts]`).
///
/// Panics if the config is inconsistent or the slice lengths do not match it.
pub fn route(logits: &[f32], bias: &[f32], cfg: &GateConfig) -> Routing {
    route_rows(logits, bias, cfg)
}

/// [`route`] for f64 router logits (a model's router, computed in f64).
pub fn route_f64(logits: &[f64], bias: &[f32], cfg: &GateConfig) -> Routing {
    route_rows(logits, bias, cfg)
}

fn route_rows<T: Copy + Into<f64>>(logits: &[T], bias: &[f32], cfg: &GateConfig) -> Routing {
    cfg.check();
    let e = cfg.n_routed_experts;
    assert_eq!(
        bias.len(),
        e,
        "bias has {} entries, expected {e}",
        bias.len()
    );
    assert_eq!(logits.len() % e, 0, "logits are not [tokens, {e}]");
    let k = cfg.num_experts_per_tok;
    let mut routing = Routing {
        experts: Vec::with_capacity(logits.len() / e * k),
        weights: Vec::with_capacity(logits.len() / e * k),
    };
    for row in logits.chunks(e) {
        let tc = token_choice(row, bias, cfg);
        let picked = &ranked(&tc.masked)[..k];
        let raw: Vec<f64> = picked.iter().map(|&x| tc.scores[x]).collect();
        let denom = if cfg.norm_topk_prob {
            raw.iter().sum::<f64>() + 1e-20
        } else {
            1.0
        };
        routing.experts.extend_from_slice(picked);
        routing
            .weights
            .extend(raw.iter().map(|w| w / denom * cfg.routed_scaling_factor));
    }
    routing
}

/// Per token, how far the selection is from changing: the smaller of the gap
/// between the last kept and first dropped group score and the gap between the k-th
/// and (k+1)-th masked choice (infinite when nothing is dropped). A kernel computing
/// in lower precision can only disagree with [`route`] on tokens whose margin is
/// below its rounding error; tests should skip or regenerate those.
pub fn selection_margins(logits: &[f32], bias: &[f32], cfg: &GateConfig) -> Vec<f64> {
    cfg.check();
    let k = cfg.num_experts_per_tok;
    logits
        .chunks(cfg.n_routed_experts)
        .map(|row| {
            let tc = token_choice(row, bias, cfg);
            let gap = |values: &[f64], keep: usize| {
                let r = ranked(values);
                match r.get(keep) {
                    Some(&next) if values[next].is_finite() => values[r[keep - 1]] - values[next],
                    _ => f64::INFINITY,
                }
            };
            gap(&tc.group_scores, cfg.topk_group).min(gap(&tc.masked, k))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(n_group: usize, topk_group: usize, k: usize) -> GateConfig {
        GateConfig {
            n_routed_experts: 8,
            num_experts_per_tok: k,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    }

    #[test]
    fn bias_steers_selection_but_not_weights() {
        let logits = [0.0f32; 8];
        let mut bias = [0.0f32; 8];
        bias[5] = 1.0;
        bias[2] = 0.5;
        let r = route(&logits, &bias, &tiny(1, 1, 2));
        assert_eq!(r.experts, vec![5, 2]);
        // Both unbiased scores are sigmoid(0) = 0.5: normalized to 0.5 each, times 2.
        assert_eq!(r.weights, vec![1.0, 1.0]);
    }

    #[test]
    fn ties_go_to_the_lowest_expert_index() {
        let r = route(&[1.0f32; 8], &[0.0; 8], &tiny(1, 1, 3));
        assert_eq!(r.experts, vec![0, 1, 2]);
    }

    #[test]
    fn dropped_groups_are_never_selected() {
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Expert 0 alone is the best, but its
        // group's top-2 sum loses to groups {4,5} and {6,7}.
        let logits = [5.0f32, -5.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.5];
        let r = route(&logits, &[0.0; 8], &tiny(4, 2, 3));
        assert_eq!(r.experts, vec![4, 5, 7]);
        let margins = selection_margins(&logits, &[0.0; 8], &tiny(4, 2, 3));
        assert!(margins[0] > 0.0 && margins[0].is_finite());
    }

    #[test]
    fn dropped_groups_lose_even_to_negative_choices() {
        // HF 5.x masks dropped groups to -inf: with kept-group choices pushed below
        // zero by the bias, top-k still stays inside the kept groups {2, 3} and {4, 5}
        // (a 0.0 fill would pick experts of the dropped groups {0, 1} and {6, 7}).
        let logits = [0.0f32, 0.0, 3.0, 3.0, -8.0, -8.0, -8.0, -8.0];
        let bias = [-0.6f32, -0.6, -1.0, -1.0, -0.1, -0.1, -0.1, -0.1];
        let cfg = tiny(4, 2, 3);
        let r = route(&logits, &bias, &cfg);
        assert_eq!(r.experts, vec![2, 3, 4]);
        assert_eq!(route_f64(&logits.map(f64::from), &bias, &cfg), r);
    }

    #[test]
    fn weights_are_normalized_unbiased_scores() {
        let logits = [0.0f32, 10.0, -10.0, 3.0, 0.0, 0.0, 0.0, 0.0];
        let mut cfg = tiny(1, 1, 2);
        let r = route(&logits, &[0.0; 8], &cfg);
        assert_eq!(r.experts, vec![1, 3]);
        let (a, b) = (sigmoid(10.0), sigmoid(3.0));
        assert!((r.weights[0] - 2.0 * a / (a + b)).abs() < 1e-15);
        cfg.norm_topk_prob = false;
        let r = route(&logits, &[0.0; 8], &cfg);
        assert!((r.weights[1] - 2.0 * b).abs() < 1e-15);
    }
}
