//! The server's own token counters, read from its Prometheus `/metrics` text, so a point
//! can report the cache hit rate the server measured beside the one the bench computed.
//!
//! Names tried, in order: kiln's (`kiln_prompt_tokens_total`, `kiln_cached_tokens_total`)
//! and SGLang's (`sglang:prompt_tokens_total`, `sglang:cached_tokens_total`). Samples of
//! one metric with different labels (one per model or replica) are summed. kiln also
//! counts the cached tokens that came from its host tier (`kiln_host_cached_tokens_total`).

/// Prompt and cached tokens the server has counted since it started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenCounters {
    /// Total prompt tokens.
    pub prompt: f64,
    /// Total prompt tokens served from the prefix cache.
    pub cached: f64,
    /// Of those, the tokens served from a host-RAM tier, where the server says.
    pub host: Option<f64>,
}

impl TokenCounters {
    /// Reads the counters from Prometheus text, if the server exports them.
    pub fn parse(text: &str) -> Option<Self> {
        [
            ("kiln_prompt_tokens_total", "kiln_cached_tokens_total"),
            ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),
        ]
        .iter()
        .find_map(|(p, c)| {
            Some(Self {
                prompt: sum(text, p)?,
                cached: sum(text, c)?,
                host: sum(text, "kiln_host_cached_tokens_total"),
            })
        })
    }

    /// Cache hit rate between two readings, when prompt tokens were counted in between.
    pub fn hit_rate_since(&self, before: &Self) -> Option<f64> {
        let prompt = self.prompt - before.prompt;
        (prompt > 0.0).then(|| (self.cached - before.cached) / prompt)
    }

    /// The share of prompt tokens between two readings served from the host tier.
    pub fn host_hit_rate_since(&self, before: &Self) -> Option<f64> {
        let prompt = self.prompt - before.prompt;
        let host = self.host? - before.host?;
        (prompt > 0.0).then(|| host / prompt)
    }
}

/// Sum of every sample of metric `name`, or `None` if it has none.
fn sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            // The name must end here: a space or labels follow, not a longer name.
            let rest = match rest.chars().next()? {
                '{' => &rest[rest.find('}')? + 1..],
                ' ' => rest,
                _ => return None,
            };
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kiln_counters_are_read_and_labels_summed() {
        let text = "# HELP kiln_prompt_tokens_total Prompt tokens.\n\
                    # TYPE kiln_prompt_tokens_total counter\n\
                    kiln_prompt_tokens_total 1000\n\
                    kiln_prompt_tokens_total_created 5\n\
                    kiln_cached_tokens_total{model=\"a\"} 300\n\
                    kiln_cached_tokens_total{model=\"b\"} 200 1700000000\n";
        let c = TokenCounters::parse(text).unwrap();
        assert_eq!(
            c,
            TokenCounters {
                prompt: 1000.0,
                cached: 500.0,
                host: None,
            }
        );
    }

    #[test]
    fn kilns_host_tier_share_is_read_between_two_readings() {
        let reading = |prompt, cached, host| {
            let text = format!(
                "kiln_prompt_tokens_total {prompt}\nkiln_cached_tokens_total {cached}\n\
                 kiln_host_cached_tokens_total {host}\n"
            );
            TokenCounters::parse(&text).unwrap()
        };
        let (before, after) = (reading(100, 50, 10), reading(1100, 950, 410));
        assert_eq!(after.hit_rate_since(&before), Some(0.9));
        assert_eq!(after.host_hit_rate_since(&before), Some(0.4));
    }

    #[test]
    fn sglang_names_are_the_fallback() {
        let text = "sglang:prompt_tokens_total{model_name=\"m\"} 10\nsglang:cached_tokens_total{model_name=\"m\"} 4\n";
        assert_eq!(
            TokenCounters::parse(text),
            Some(TokenCounters {
                prompt: 10.0,
                cached: 4.0,
                host: None,
            })
        );
        assert_eq!(TokenCounters::parse("other_metric 1\n"), None);
    }

    #[test]
    fn the_hit_rate_is_taken_over_the_difference() {
        let before = TokenCounters {
            prompt: 100.0,
            cached: 10.0,
            host: None,
        };
        let after = TokenCounters {
            prompt: 300.0,
            cached: 160.0,
            host: None,
        };
        assert_eq!(after.hit_rate_since(&before), Some(0.75));
        assert_eq!(before.hit_rate_since(&before), None);
        assert_eq!(after.host_hit_rate_since(&before), None, "no host counter");
    }
}
