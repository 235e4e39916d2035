//! A sweep's report: JSON of every point with what produced it, and the summary table.
use crate::error::WorkloadError;
use crate::metrics::{Distribution, PointSummary};
use crate::params::WorkloadParams;
use serde::{Deserialize, Serialize};

/// Where the requests came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkloadSource {
    /// Generated closed-loop sessions.
    Sessions {
        /// The parameters, after `--scale` and the think-time factor.
        params: WorkloadParams,
    },
    /// A replayed Mooncake trace.
    Trace {
        /// The trace file.
        path: String,
        /// Requests in it.
        requests: usize,
        /// Sent on the trace's clock (else closed-loop).
        timed: bool,
    },
}

/// Everything `kiln bench` measured, as written to `--json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// Server base URL.
    pub url: String,
    /// Model name sent.
    pub model: String,
    /// `generate` (token ids) or `text` (OpenAI completions).
    pub api: String,
    /// Workload seed.
    pub seed: u64,
    /// Context scale (1 = full scale).
    pub scale: f64,
    /// Seconds each point ran (new turns stop after it; in-flight ones finish).
    pub duration_s: f64,
    /// What was sent.
    pub workload: WorkloadSource,
    /// One summary per concurrency, in sweep order.
    pub points: Vec<PointSummary>,
}

impl BenchReport {
    /// Reads a report [`Self::write_json`] wrote.
    pub fn read_json(path: &std::path::Path) -> Result<Self, WorkloadError> {
        let io = |source| WorkloadError::Io {
            path: path.display().to_string(),
            source,
        };
        let text = std::fs::read_to_string(path).map_err(io)?;
        serde_json::from_str(&text)
            .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
    }

    /// Writes the report as pretty JSON.
    pub fn write_json(&self, path: &std::path::Path) -> Result<(), WorkloadError> {
        let text = serde_json::to_string_pretty(self).expect("a report always serialises");
        std::fs::write(path, text + "\n").map_err(|source| WorkloadError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

/// The summary table: one row per point. CHR is the bench's cache hit rate (from the
/// responses), `server` the server's own over the point, when it exports counters.
pub fn table(points: &[PointSummary]) -> String {
    let row = |c: [&str; 11]| {
        format!(
            "{:>5} {:>6} {:>4} | {:>22} | {:>13} | {:>16} | {:>11} {:>11} | {:>6} {:>6} | {:>6}\n",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10]
        )
    };
    let mut s = row([
        "point",
        "reqs",
        "err",
        "TTFT s p50/p90/p99",
        "e2e s p50/p99",
        "out tok/s/user",
        "tok/min/GPU",
        "out/min/GPU",
        "CHR",
        "server",
        "accept",
    ]);
    let pct = |r: Option<f64>| r.map_or("-".into(), |c| format!("{:.1}%", c * 100.0));
    for p in points {
        let ttft = three(p.ttft_s, |d| [d.p50, d.p90, d.p99]);
        let e2e = p
            .e2e_s
            .map_or("-".into(), |d| format!("{:.2}/{:.2}", d.p50, d.p99));
        let tps = p
            .output_tps_per_user
            .map_or("-".into(), |d| format!("{:.1} (p10 {:.1})", d.p50, d.p10));
        let accept = p.accept_len.map_or("-".into(), |a| format!("{a:.2}"));
        s += &row([
            &p.label(),
            &p.requests.to_string(),
            &p.errors.to_string(),
            &ttft,
            &e2e,
            &tps,
            &human(p.tokens_per_min_per_gpu),
            &human(p.output_tokens_per_min_per_gpu),
            &pct(p.cache_hit_rate),
            &match p.server_host_hit_rate.filter(|&h| h > 0.0) {
                Some(host) => format!(
                    "{} ({} host)",
                    pct(p.server_cache_hit_rate),
                    pct(Some(host))
                ),
                None => pct(p.server_cache_hit_rate),
            },
            &accept,
        ]);
    }
    s
}

fn three(d: Option<Distribution>, f: impl Fn(Distribution) -> [f64; 3]) -> String {
    d.map_or("-".into(), |d| {
        let [a, b, c] = f(d);
        format!("{a:.3}/{b:.3}/{c:.3}")
    })
}

/// `12345678` as `12.3M`.
fn human(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.2}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.1}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{summarize, RequestRecord};

    #[test]
    fn the_table_has_a_row_per_point_with_its_numbers() {
        let r = RequestRecord {
            start_s: 0.0,
            ttft_s: Some(0.25),
            e2e_s: 1.25,
            prompt_tokens: 1_000_000,
            completion_tokens: 101,
            cached_tokens: Some(750_000),
            spec_verify_ct: None,
            error: None,
        };
        let t = table(&[summarize(4, 1, 60.0, &[r])]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        let row = lines[1];
        assert!(row.trim_start().starts_with("c=4 "), "{row}");
        for want in ["0.250/0.250/0.250", "1.25/1.25", "100.0", "1.00M", "75.0%"] {
            assert!(row.contains(want), "{want} missing in {row}");
        }
    }
}
