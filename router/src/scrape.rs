//! Reading a replica's load from its Prometheus /metrics text.
//!
//! kiln replicas export `kiln_num_running_reqs`, `kiln_num_queue_reqs` and
//! `kiln_kv_usage` (0..1); SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs`
//! and `sglang:token_usage` mean the same and are read too, so the router also fronts
//! SGLang. Series with labels are summed per name (one series per data-parallel rank).
//! Comments, unknown names and unparsable lines are skipped.

use crate::placer::Scraped;

/// The load in one /metrics page, or `None` if it has no running-requests gauge.
pub fn parse_metrics(text: &str) -> Option<Scraped> {
    let (mut running, mut queued, mut kv) = (None::<f64>, 0.0, 0.0f64);
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        match name {
            "kiln_num_running_reqs" | "sglang:num_running_reqs" => {
                *running.get_or_insert(0.0) += value
            }
            "kiln_num_queue_reqs" | "sglang:num_queue_reqs" => queued += value,
            "kiln_kv_usage" | "sglang:token_usage" => kv = kv.max(value),
            _ => {}
        }
    }
    Some(Scraped {
        requests: running? + queued,
        kv_usage: kv.clamp(0.0, 1.0),
    })
}

/// Whether a kiln replica drains for shutdown (`kiln_draining 1`): it answers new
/// requests with 503 until it exits, so it leaves the rotation at once.
pub fn is_draining(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("kiln_draining "))
        .any(|v| v.trim().parse::<f64>().is_ok_and(|v| v > 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_draining_replica_says_so() {
        assert!(is_draining("kiln_num_running_reqs 1\nkiln_draining 1\n"));
        assert!(!is_draining("kiln_draining 0\n"));
        assert!(!is_draining("kiln_num_running_reqs 1\n"));
    }

    #[test]
    fn kiln_metrics_give_running_plus_queued_and_kv_usage() {
        let text = "# HELP kiln_num_running_reqs Running requests\n\
                    # TYPE kiln_num_running_reqs gauge\n\
                    kiln_num_running_reqs 3\n\
                    kiln_num_queue_reqs 2\n\
                    kiln_kv_usage 0.25\n\
                    kiln_prompt_tokens_total 12345\n";
        assert_eq!(
            parse_metrics(text),
            Some(Scraped {
                requests: 5.0,
                kv_usage: 0.25
            })
        );
    }

    #[test]
    fn labelled_sglang_series_are_summed_per_name() {
        let text = "sglang:num_running_reqs{model_name=\"m\",dp_rank=\"0\"} 2.0\n\
                    sglang:num_running_reqs{model_name=\"m\",dp_rank=\"1\"} 4.0\n\
                    sglang:token_usage{model_name=\"m\"} 0.5\n";
        assert_eq!(
            parse_metrics(text),
            Some(Scraped {
                requests: 6.0,
                kv_usage: 0.5
            })
        );
    }

    #[test]
    fn a_page_without_a_running_gauge_is_not_a_replica_load() {
        assert_eq!(parse_metrics("up 1\nkiln_kv_usage nonsense\n"), None);
    }
}
