//! The engine's counters, gauges and latency histograms, rendered in Prometheus' text
//! format for `GET /metrics`. Names follow SGLang's where one exists (`num_running_reqs`,
//! `num_queue_reqs`, `cache_hit_rate`, `time_to_first_token_seconds`), prefixed `kiln_`.
//! Updated by the engine thread with relaxed atomics; read by the server at any time.
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::model::gpu::GraphStats;

/// A gauge holding an f64.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// A counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
    /// Moves the count up to `total`, a running total kept elsewhere.
    pub fn raise_to(&self, total: u64) {
        self.0.fetch_max(total, Relaxed);
    }
}

/// A histogram with fixed bucket bounds: latencies in seconds, or plain values.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    /// The sum of observations, an f64's bits.
    sum: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
            count: AtomicU64::new(0),
        }
    }

    /// A latency, in seconds.
    pub fn observe(&self, d: Duration) {
        self.observe_value(d.as_secs_f64());
    }

    pub fn observe_value(&self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        let add = |bits| Some((f64::from_bits(bits) + v).to_bits());
        let _ = self.sum.fetch_update(Relaxed, Relaxed, add);
        self.count.fetch_add(1, Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Relaxed))
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, n) in self.bounds.iter().zip(&self.buckets) {
            cumulative += n.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum();
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
];
/// Tokens one verify step emits: 1 (nothing accepted) to a draft of 15 all accepted.
const ACCEPT_LENGTH_BOUNDS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.0, 16.0];

/// Everything `/metrics` reports.
#[derive(Debug)]
pub struct Metrics {
    pub running: Gauge,
    pub queued: Gauge,
    /// Share of KV pages held by requests (pages only the prefix cache holds are free to
    /// evict and not counted).
    pub kv_usage: Gauge,
    pub kv_cached_pages: Gauge,
    pub kv_total_pages: Gauge,
    /// The host tier: slots in use, slots in all, and pages copied each way.
    pub kv_host_pages: Gauge,
    pub kv_host_total_pages: Gauge,
    /// Pages whose copy to the host is in flight (read back, not yet in their slots).
    pub kv_host_copy_queue_pages: Gauge,
    pub kv_pages_to_host: Counter,
    pub kv_pages_to_device: Counter,
    pub kv_bytes_to_host: Counter,
    pub kv_bytes_to_device: Counter,
    pub prompt_tokens: Counter,
    /// Prompt tokens served from the cache, and those of them that came from the host tier.
    pub cached_tokens: Counter,
    pub host_cached_tokens: Counter,
    pub generation_tokens: Counter,
    pub requests_finished: Counter,
    pub requests_aborted: Counter,
    pub requests_rejected: Counter,
    pub preemptions: Counter,
    /// Times a waiting request began to wait for a running prefill of its prefix.
    pub prefill_waits: Counter,
    pub steps: Counter,
    /// Steps planned and issued while the step before was still on the device.
    pub overlapped_steps: Counter,
    /// Where the engine thread's time goes, step by step, for decode steps and for steps
    /// that prefill ([`StepKind`]).
    pub step_times: [StepTimes; 2],
    /// Speculative decoding: tokens drafted, and those verification accepted.
    pub spec_drafted_tokens: Counter,
    pub spec_accepted_tokens: Counter,
    /// Tokens each verify step of a request with a draft emitted (accepted drafts and the
    /// model's own token).
    pub spec_accept_length: Histogram,
    pub spec_drafter_bytes: Gauge,
    /// What the draft policy decided for each decode step, by [`PolicyDecision`].
    pub spec_policy_steps: [Counter; 4],
    /// The decode graphs (`--cuda-graph-sizes`): kept, their memory, recorded, replayed.
    pub cuda_graphs: Gauge,
    pub cuda_graph_bytes: Gauge,
    pub cuda_graph_recordings: Counter,
    pub cuda_graph_replays: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            running: Gauge::default(),
            queued: Gauge::default(),
            kv_usage: Gauge::default(),
            kv_cached_pages: Gauge::default(),
            kv_total_pages: Gauge::default(),
            kv_host_pages: Gauge::default(),
            kv_host_total_pages: Gauge::default(),
            kv_host_copy_queue_pages: Gauge::default(),
            kv_pages_to_host: Counter::default(),
            kv_pages_to_device: Counter::default(),
            kv_bytes_to_host: Counter::default(),
            kv_bytes_to_device: Counter::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            host_cached_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            requests_finished: Counter::default(),
            requests_aborted: Counter::default(),
            requests_rejected: Counter::default(),
            preemptions: Counter::default(),
            prefill_waits: Counter::default(),
            overlapped_steps: Counter::default(),
            steps: Counter::default(),
            step_times: Default::default(),
            spec_drafted_tokens: Counter::default(),
            spec_accepted_tokens: Counter::default(),
            spec_accept_length: Histogram::new(ACCEPT_LENGTH_BOUNDS),
            spec_drafter_bytes: Gauge::default(),
            spec_policy_steps: Default::default(),
            cuda_graphs: Gauge::default(),
            cuda_graph_bytes: Gauge::default(),
            cuda_graph_recordings: Counter::default(),
            cuda_graph_replays: Counter::default(),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

/// What the measured draft policy decided for a step's decoding requests, for
/// `kiln_spec_policy_steps_total`'s `decision` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyDecision {
    /// Some request drafts.
    Draft,
    /// Measured, and no draft pays.
    NoGain,
    /// The batch's plain step has no measured time yet.
    Unmeasured,
    /// A plain step asked for, to measure the plain step again.
    Probe,
}

impl PolicyDecision {
    const ALL: [(&'static str, PolicyDecision); 4] = [
        ("draft", PolicyDecision::Draft),
        ("no_gain", PolicyDecision::NoGain),
        ("unmeasured", PolicyDecision::Unmeasured),
        ("probe", PolicyDecision::Probe),
    ];
}

/// What a step ran, for the step-time counters' `kind` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Every request ran its one last token (and any draft to verify).
    Decode = 0,
    /// Some request ran prompt tokens (a prefill or extend chunk).
    Prefill = 1,
}

/// Steps of one [`StepKind`] and the engine thread's time in their phases (microseconds):
/// planning the step, issuing its kernels, waiting for the device and reading the logits
/// back, then sampling and handing out tokens.
#[derive(Debug, Default)]
pub struct StepTimes {
    pub steps: Counter,
    pub schedule_us: Counter,
    pub issue_us: Counter,
    pub device_us: Counter,
    pub complete_us: Counter,
}

impl Metrics {
    /// Adds one step's phases to the step-time counters of its kind.
    pub fn record_step(
        &self,
        kind: StepKind,
        schedule: Duration,
        issue: Duration,
        device: Duration,
        complete: Duration,
    ) {
        let us = |d: Duration| d.as_micros() as u64;
        let t = &self.step_times[kind as usize];
        t.steps.add(1);
        t.schedule_us.add(us(schedule));
        t.issue_us.add(us(issue));
        t.device_us.add(us(device));
        t.complete_us.add(us(complete));
    }

    /// The model's decode graphs as [`GpuModel::graph_stats`] reports them.
    pub fn record_graphs(&self, g: GraphStats) {
        self.cuda_graphs.set(g.held as f64);
        self.cuda_graph_bytes.set(g.held_bytes as f64);
        self.cuda_graph_recordings.raise_to(g.recorded);
        self.cuda_graph_replays.raise_to(g.replayed);
    }

    /// Cached prompt tokens over all prompt tokens admitted so far (0 before any).
    pub fn cache_hit_rate(&self) -> f64 {
        let prompt = self.prompt_tokens.get();
        if prompt == 0 {
            0.0
        } else {
            self.cached_tokens.get() as f64 / prompt as f64
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, v: f64| {
            let _ = writeln!(
                out,
                "# HELP kiln_{name} {help}\n# TYPE kiln_{name} gauge\nkiln_{name} {v}"
            );
        };
        gauge(
            "num_running_reqs",
            "Requests in the running batch.",
            self.running.get(),
        );
        gauge(
            "num_queue_reqs",
            "Requests waiting for admission.",
            self.queued.get(),
        );
        gauge(
            "kv_usage",
            "Share of KV pages held by requests.",
            self.kv_usage.get(),
        );
        gauge(
            "kv_cached_pages",
            "KV pages held by the prefix cache.",
            self.kv_cached_pages.get(),
        );
        gauge(
            "kv_total_pages",
            "KV pages in the pool.",
            self.kv_total_pages.get(),
        );
        gauge(
            "kv_host_pages",
            "KV pages the host tier holds.",
            self.kv_host_pages.get(),
        );
        gauge(
            "kv_host_total_pages",
            "KV pages the host tier can hold.",
            self.kv_host_total_pages.get(),
        );
        gauge(
            "kv_host_copy_queue_pages",
            "KV pages whose copy to the host tier is in flight.",
            self.kv_host_copy_queue_pages.get(),
        );
        gauge(
            "spec_drafter_bytes",
            "Host memory the speculative drafter's tables hold, about.",
            self.spec_drafter_bytes.get(),
        );
        gauge(
            "cuda_graphs",
            "Decode steps' CUDA graphs kept.",
            self.cuda_graphs.get(),
        );
        gauge(
            "cuda_graph_bytes",
            "Device memory the kept CUDA graphs hold.",
            self.cuda_graph_bytes.get(),
        );
        gauge(
            "cache_hit_rate",
            "Cached prompt tokens over prompt tokens.",
            self.cache_hit_rate(),
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP kiln_{name} {help}\n# TYPE kiln_{name} counter\nkiln_{name} {v}"
            );
        };
        counter(
            "prompt_tokens_total",
            "Prompt tokens admitted.",
            self.prompt_tokens.get(),
        );
        counter(
            "cached_tokens_total",
            "Prompt tokens served from the prefix cache.",
            self.cached_tokens.get(),
        );
        counter(
            "host_cached_tokens_total",
            "Prompt tokens served from the prefix cache's host tier (copied back to the device).",
            self.host_cached_tokens.get(),
        );
        counter(
            "kv_pages_to_host_total",
            "KV pages copied from the device to the host tier.",
            self.kv_pages_to_host.get(),
        );
        counter(
            "kv_pages_to_device_total",
            "KV pages copied from the host tier back to the device.",
            self.kv_pages_to_device.get(),
        );
        counter(
            "kv_bytes_to_host_total",
            "Bytes of KV copied from the device to the host tier.",
            self.kv_bytes_to_host.get(),
        );
        counter(
            "kv_bytes_to_device_total",
            "Bytes of KV copied from the host tier back to the device.",
            self.kv_bytes_to_device.get(),
        );
        counter(
            "generation_tokens_total",
            "Tokens generated.",
            self.generation_tokens.get(),
        );
        counter(
            "requests_finished_total",
            "Requests that finished.",
            self.requests_finished.get(),
        );
        counter(
            "requests_aborted_total",
            "Requests whose client went away.",
            self.requests_aborted.get(),
        );
        counter(
            "requests_rejected_total",
            "Requests refused (bad input or a full queue).",
            self.requests_rejected.get(),
        );
        counter(
            "preemptions_total",
            "Requests preempted to free KV pages.",
            self.preemptions.get(),
        );
        counter(
            "prefill_waits_total",
            "Times a waiting request began to wait for a running prefill of its prefix, to reuse it.",
            self.prefill_waits.get(),
        );
        counter("steps_total", "Forward steps run.", self.steps.get());
        counter(
            "overlapped_steps_total",
            "Steps planned and issued while the step before ran on the device.",
            self.overlapped_steps.get(),
        );
        counter(
            "cuda_graph_recordings_total",
            "Decode steps recorded as CUDA graphs (one per shape; rising under steady load means shapes churn).",
            self.cuda_graph_recordings.get(),
        );
        counter(
            "cuda_graph_replays_total",
            "Decode steps replayed from a CUDA graph.",
            self.cuda_graph_replays.get(),
        );
        counter(
            "spec_drafted_tokens_total",
            "Tokens drafted for speculative decoding.",
            self.spec_drafted_tokens.get(),
        );
        counter(
            "spec_accepted_tokens_total",
            "Drafted tokens verification accepted.",
            self.spec_accepted_tokens.get(),
        );
        let _ = writeln!(
            out,
            "# HELP kiln_spec_policy_steps_total Decode steps by what the measured draft \
             policy decided: draft, no_gain (no draft pays), unmeasured (no plain step of \
             the batch timed yet), probe (a plain step to time it again).\n\
             # TYPE kiln_spec_policy_steps_total counter"
        );
        for (label, decision) in PolicyDecision::ALL {
            let v = self.spec_policy_steps[decision as usize].get();
            let _ = writeln!(
                out,
                "kiln_spec_policy_steps_total{{decision=\"{label}\"}} {v}"
            );
        }
        let kinds = [("decode", StepKind::Decode), ("prefill", StepKind::Prefill)];
        let mut labelled = |name: &str, help: &str, value: &dyn Fn(&StepTimes) -> u64| {
            let _ = writeln!(out, "# HELP kiln_{name} {help}\n# TYPE kiln_{name} counter");
            for (label, kind) in kinds {
                let v = value(&self.step_times[kind as usize]);
                let _ = writeln!(out, "kiln_{name}{{kind=\"{label}\"}} {v}");
            }
        };
        labelled(
            "steps_by_kind_total",
            "Forward steps run, by kind: decode (every request ran one token, drafts \
             aside) or prefill (some request ran prompt tokens).",
            &|t| t.steps.get(),
        );
        for (name, help, value) in [
            (
                "schedule",
                "planning steps",
                (&|t: &StepTimes| t.schedule_us.get()) as &dyn Fn(&StepTimes) -> u64,
            ),
            ("issue", "issuing steps' kernels", &|t| t.issue_us.get()),
            (
                "device",
                "waiting for the device and reading logits back",
                &|t| t.device_us.get(),
            ),
            ("complete", "sampling and handing out tokens", &|t| {
                t.complete_us.get()
            }),
        ] {
            labelled(
                &format!("step_{name}_microseconds_total"),
                &format!("Engine-thread time spent {help}, by step kind."),
                value,
            );
        }
        self.ttft.render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "Time from arrival to the first token.",
        );
        self.itl.render(
            &mut out,
            "kiln_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
        );
        self.spec_accept_length.render(
            &mut out,
            "kiln_spec_accept_length",
            "Tokens a speculative verify step gave one request with a draft: the drafted \
             tokens verification accepted and the model's own (a stop or the length limit \
             may cut what is sent).",
        );
        self.render_peer_names(&mut out);
        out
    }

    /// The queue, running and KV-usage gauges again under the names vLLM and SGLang
    /// export, which the Kubernetes Gateway API Inference Extension's endpoint picker
    /// (its model-server protocol) and existing dashboards read.
    fn render_peer_names(&self, out: &mut String) {
        let (queued, running, usage) = (self.queued.get(), self.running.get(), self.kv_usage.get());
        for (name, help, v) in [
            (
                "vllm:num_requests_waiting",
                "Requests waiting (kiln_num_queue_reqs).",
                queued,
            ),
            (
                "vllm:num_requests_running",
                "Requests running (kiln_num_running_reqs).",
                running,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV cache usage, 1 = full (kiln_kv_usage).",
                usage,
            ),
            (
                "vllm:gpu_cache_usage_perc",
                "KV cache usage, 1 = full (kiln_kv_usage).",
                usage,
            ),
            (
                "sglang:num_queue_reqs",
                "Requests waiting (kiln_num_queue_reqs).",
                queued,
            ),
            (
                "sglang:num_running_reqs",
                "Requests running (kiln_num_running_reqs).",
                running,
            ),
            (
                "sglang:token_usage",
                "KV cache usage, 1 = full (kiln_kv_usage).",
                usage,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_and_kv_usage_are_also_exported_under_vllm_and_sglang_names() {
        let m = Metrics::default();
        m.queued.set(3.0);
        m.running.set(5.0);
        m.kv_usage.set(0.25);
        let text = m.render();
        for line in [
            "vllm:num_requests_waiting 3",
            "vllm:num_requests_running 5",
            "vllm:kv_cache_usage_perc 0.25",
            "vllm:gpu_cache_usage_perc 0.25",
            "sglang:num_queue_reqs 3",
            "sglang:num_running_reqs 5",
            "sglang:token_usage 0.25",
            "# TYPE sglang:token_usage gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let m = Metrics::default();
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_millis(70));
        m.ttft.observe(Duration::from_secs(100));
        let text = m.render();
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"0.1\"} 2"));
        assert!(text.contains("kiln_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("kiln_time_to_first_token_seconds_count 3"));
        let sum = text
            .lines()
            .find_map(|l| l.strip_prefix("kiln_time_to_first_token_seconds_sum "))
            .and_then(|v| v.parse::<f64>().ok());
        assert!(sum.is_some_and(|s| (s - 100.073).abs() < 1e-9), "{sum:?}");
    }

    #[test]
    fn the_accept_length_histogram_counts_tokens_per_verify_step() {
        let m = Metrics::default();
        for len in [1.0, 3.0, 3.0, 6.0] {
            m.spec_accept_length.observe_value(len);
        }
        let text = m.render();
        for line in [
            "kiln_spec_accept_length_bucket{le=\"1\"} 1",
            "kiln_spec_accept_length_bucket{le=\"2\"} 1",
            "kiln_spec_accept_length_bucket{le=\"3\"} 3",
            "kiln_spec_accept_length_bucket{le=\"6\"} 4",
            "kiln_spec_accept_length_bucket{le=\"+Inf\"} 4",
            "kiln_spec_accept_length_sum 13",
            "kiln_spec_accept_length_count 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing");
        }
    }

    #[test]
    fn step_times_are_counted_under_their_kind() {
        let m = Metrics::default();
        let ms = Duration::from_millis;
        m.record_step(StepKind::Decode, ms(1), ms(2), ms(3), ms(4));
        m.record_step(StepKind::Decode, ms(1), ms(2), ms(3), ms(4));
        m.record_step(StepKind::Prefill, ms(5), ms(6), ms(70), ms(8));
        let text = m.render();
        for line in [
            "kiln_steps_by_kind_total{kind=\"decode\"} 2",
            "kiln_steps_by_kind_total{kind=\"prefill\"} 1",
            "kiln_step_issue_microseconds_total{kind=\"decode\"} 4000",
            "kiln_step_device_microseconds_total{kind=\"prefill\"} 70000",
            "kiln_step_complete_microseconds_total{kind=\"decode\"} 8000",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing");
        }
    }

    #[test]
    fn graph_stats_are_rendered_as_the_model_last_reported_them() {
        let m = Metrics::default();
        let stats = |held, recorded, replayed| GraphStats {
            held,
            held_bytes: (held as u64) << 20,
            recorded,
            replayed,
        };
        m.record_graphs(stats(3, 5, 100));
        // One more recorded, the least recently run of the kept ones dropped.
        m.record_graphs(stats(2, 6, 130));
        let text = m.render();
        for line in [
            "kiln_cuda_graphs 2",
            "kiln_cuda_graph_bytes 2097152",
            "kiln_cuda_graph_recordings_total 6",
            "kiln_cuda_graph_replays_total 130",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing");
        }
    }

    #[test]
    fn the_hit_rate_is_cached_over_prompt_tokens() {
        let m = Metrics::default();
        assert_eq!(m.cache_hit_rate(), 0.0);
        m.prompt_tokens.add(200);
        m.cached_tokens.add(150);
        assert!(m.render().contains("kiln_cache_hit_rate 0.75"));
    }
}
