//! Per-request records and the summary of one concurrency point.
//!
//! Definitions (those of SGLang's `bench_serving` and AIPerf where they overlap):
//! - TTFT: request sent to first output token received (streaming).
//! - Output tokens/s per user: `(completion_tokens - 1) / (e2e - ttft)`, the decode speed
//!   one user sees after the first token; requests with fewer than 2 tokens have none.
//! - Tokens/min per GPU: prompt plus completion tokens of successful requests over the
//!   point's wall time, per GPU (`--gpus`); the output-only rate is reported beside it.
//! - Cache hit rate: sum of `cached_tokens` over sum of prompt tokens, over the requests
//!   whose server reported `cached_tokens` (none reported: no rate).
//! - Accept length: completion tokens per speculative verify step, from SGLang's
//!   `spec_verify_ct` when the server reports it.
//!
//! Percentiles interpolate linearly between closest ranks (numpy's default).
use serde::{Deserialize, Serialize};

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Seconds from the point's start to sending the request.
    pub start_s: f64,
    /// Seconds to the first output token, if one arrived.
    pub ttft_s: Option<f64>,
    /// Seconds from sending to the last byte of the response.
    pub e2e_s: f64,
    /// Prompt tokens (the server's count when it reports one).
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub completion_tokens: u64,
    /// Prompt tokens served from the server's prefix cache, when reported.
    pub cached_tokens: Option<u64>,
    /// Speculative verify steps, when reported (SGLang `meta_info.spec_verify_ct`).
    pub spec_verify_ct: Option<u64>,
    /// Why the request failed, if it did.
    pub error: Option<String>,
}

impl RequestRecord {
    /// Decode speed after the first token, when defined.
    pub fn output_tps(&self) -> Option<f64> {
        let ttft = self.ttft_s?;
        let decode = self.e2e_s - ttft;
        (self.error.is_none() && self.completion_tokens >= 2 && decode > 0.0)
            .then(|| (self.completion_tokens - 1) as f64 / decode)
    }
}

/// Mean and percentiles of a sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    /// Arithmetic mean.
    pub mean: f64,
    /// 10th percentile (the slow tail of a speed).
    pub p10: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Distribution {
    /// The summary of `xs`, or `None` when it is empty.
    pub fn of(xs: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = xs.into_iter().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Self {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p10: percentile(&v, 10.0),
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
        })
    }
}

/// The `q`-th percentile of sorted, non-empty `v`, interpolating between closest ranks.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    let rank = q / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// Everything measured at one concurrency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointSummary {
    /// Concurrent sessions (closed loop) or replay workers; 0 for a trace replayed on its
    /// own clock.
    pub concurrency: u32,
    /// Wall time of the point, first send to last response.
    pub elapsed_s: f64,
    /// GPUs the server runs on (divides the throughput).
    pub gpus: u32,
    /// Requests completed or failed.
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// The first few error messages.
    pub error_samples: Vec<String>,
    /// Time to first token, seconds.
    pub ttft_s: Option<Distribution>,
    /// Request latency, seconds.
    pub e2e_s: Option<Distribution>,
    /// Output tokens/s per user after the first token.
    pub output_tps_per_user: Option<Distribution>,
    /// Prompt plus completion tokens per minute per GPU.
    pub tokens_per_min_per_gpu: f64,
    /// Completion tokens per minute per GPU.
    pub output_tokens_per_min_per_gpu: f64,
    /// Prompt tokens of successful requests.
    pub prompt_tokens: u64,
    /// Completion tokens of successful requests.
    pub completion_tokens: u64,
    /// Cached prompt tokens, over requests that reported them.
    pub cached_tokens: u64,
    /// Cached over prompt tokens, over requests that reported `cached_tokens`.
    pub cache_hit_rate: Option<f64>,
    /// Completion tokens per speculative verify step, when reported.
    pub accept_len: Option<f64>,
    /// Cache hit rate from the server's own counters over the point (its Prometheus
    /// `/metrics`), when it exports them; set by the driver.
    pub server_cache_hit_rate: Option<f64>,
    /// The part of it served from the server's host-RAM tier (kiln), when exported.
    #[serde(default)]
    pub server_host_hit_rate: Option<f64>,
}

impl PointSummary {
    /// The point's name on charts and tables ([`point_label`]).
    pub fn label(&self) -> String {
        point_label(self.concurrency)
    }
}

/// `c=N` for a point at concurrency `N`, `trace` for a replay on the trace's clock (0).
pub fn point_label(concurrency: u32) -> String {
    match concurrency {
        0 => "trace".to_string(),
        c => format!("c={c}"),
    }
}

/// How many error messages a summary keeps.
const ERROR_SAMPLES: usize = 5;

/// Summarises the records of one point.
pub fn summarize(
    concurrency: u32,
    gpus: u32,
    elapsed_s: f64,
    records: &[RequestRecord],
) -> PointSummary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let sum = |f: fn(&RequestRecord) -> u64| ok.iter().map(|r| f(r)).sum::<u64>();
    let (prompt, completion) = (sum(|r| r.prompt_tokens), sum(|r| r.completion_tokens));
    let reporting: Vec<&&RequestRecord> = ok.iter().filter(|r| r.cached_tokens.is_some()).collect();
    let cached: u64 = reporting.iter().filter_map(|r| r.cached_tokens).sum();
    let reported_prompt: u64 = reporting.iter().map(|r| r.prompt_tokens).sum();
    let per_min_per_gpu = |tokens: u64| {
        if elapsed_s > 0.0 {
            tokens as f64 * 60.0 / elapsed_s / gpus.max(1) as f64
        } else {
            0.0
        }
    };
    PointSummary {
        concurrency,
        elapsed_s,
        gpus,
        requests: records.len() as u64,
        errors: (records.len() - ok.len()) as u64,
        error_samples: records
            .iter()
            .filter_map(|r| r.error.clone())
            .take(ERROR_SAMPLES)
            .collect(),
        ttft_s: Distribution::of(ok.iter().filter_map(|r| r.ttft_s)),
        e2e_s: Distribution::of(ok.iter().map(|r| r.e2e_s)),
        output_tps_per_user: Distribution::of(ok.iter().filter_map(|r| r.output_tps())),
        tokens_per_min_per_gpu: per_min_per_gpu(prompt + completion),
        output_tokens_per_min_per_gpu: per_min_per_gpu(completion),
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: cached,
        cache_hit_rate: (reported_prompt > 0).then(|| cached as f64 / reported_prompt as f64),
        accept_len: accept_len(&ok),
        server_cache_hit_rate: None,
        server_host_hit_rate: None,
    }
}

fn accept_len(ok: &[&RequestRecord]) -> Option<f64> {
    let steps: Vec<(u64, u64)> = ok
        .iter()
        .filter_map(|r| r.spec_verify_ct.map(|v| (r.completion_tokens, v)))
        .collect();
    let verify: u64 = steps.iter().map(|s| s.1).sum();
    (verify > 0).then(|| steps.iter().map(|s| s.0).sum::<u64>() as f64 / verify as f64)
}

/// Indices of the points no other point beats on both output tokens/s per user (median)
/// and tokens/min per GPU, ordered by speed per user: the Pareto frontier of a sweep.
pub fn pareto_front(points: &[PointSummary]) -> Vec<usize> {
    let xy = |p: &PointSummary| {
        (
            p.output_tps_per_user.map_or(0.0, |d| d.p50),
            p.tokens_per_min_per_gpu,
        )
    };
    let mut front: Vec<usize> = (0..points.len())
        .filter(|&i| {
            let (x, y) = xy(&points[i]);
            !points.iter().any(|q| {
                let (qx, qy) = xy(q);
                qx >= x && qy >= y && (qx > x || qy > y)
            })
        })
        .collect();
    front.sort_by(|&a, &b| xy(&points[a]).0.total_cmp(&xy(&points[b]).0));
    front
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        ttft: f64,
        e2e: f64,
        prompt: u64,
        completion: u64,
        cached: Option<u64>,
    ) -> RequestRecord {
        RequestRecord {
            start_s: 0.0,
            ttft_s: Some(ttft),
            e2e_s: e2e,
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: cached,
            spec_verify_ct: None,
            error: None,
        }
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 90.0), 4.6);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn decode_speed_excludes_the_first_token() {
        let r = record(1.0, 3.0, 10, 21, None);
        assert_eq!(r.output_tps(), Some(10.0));
        assert_eq!(record(1.0, 3.0, 10, 1, None).output_tps(), None);
    }

    #[test]
    fn throughput_is_per_minute_per_gpu() {
        let recs = [
            record(0.1, 1.0, 100, 20, Some(50)),
            record(0.1, 1.0, 200, 40, Some(100)),
        ];
        let s = summarize(2, 2, 30.0, &recs);
        assert_eq!(s.tokens_per_min_per_gpu, 360.0 * 2.0 / 2.0);
        assert_eq!(s.output_tokens_per_min_per_gpu, 60.0);
        assert_eq!(s.cache_hit_rate, Some(0.5));
    }

    #[test]
    fn errors_are_counted_and_excluded_from_throughput() {
        let mut bad = record(0.1, 1.0, 1000, 1000, Some(0));
        bad.error = Some("HTTP 500".into());
        let s = summarize(1, 1, 60.0, &[record(0.1, 1.0, 100, 20, None), bad]);
        assert_eq!((s.requests, s.errors), (2, 1));
        assert_eq!(s.tokens_per_min_per_gpu, 120.0);
        assert_eq!(s.error_samples, vec!["HTTP 500".to_string()]);
        assert_eq!(
            s.cache_hit_rate, None,
            "no successful request reported cached tokens"
        );
    }

    #[test]
    fn accept_length_is_tokens_per_verify_step() {
        let mut a = record(0.1, 1.0, 10, 30, None);
        a.spec_verify_ct = Some(10);
        let mut b = record(0.1, 1.0, 10, 10, None);
        b.spec_verify_ct = Some(10);
        assert_eq!(summarize(1, 1, 1.0, &[a, b]).accept_len, Some(2.0));
        assert_eq!(
            summarize(1, 1, 1.0, &[record(0.1, 1.0, 1, 5, None)]).accept_len,
            None
        );
    }

    #[test]
    fn dominated_points_are_off_the_pareto_front() {
        let point = |c: u32, tps: f64, tpm: f64| {
            let mut s = summarize(c, 1, 1.0, &[]);
            s.output_tps_per_user = Distribution::of([tps]);
            s.tokens_per_min_per_gpu = tpm;
            s
        };
        let points = [
            point(1, 100.0, 10.0),
            point(2, 80.0, 30.0),
            point(4, 70.0, 20.0),
            point(8, 40.0, 50.0),
        ];
        assert_eq!(pareto_front(&points), vec![3, 1, 0]);
    }
}
