//! The router's own Prometheus /metrics, rendered from the placer's state.
//!
//! Series: `kiln_router_in_flight{replica}` and `kiln_router_replica_up{replica}`
//! (gauges), `kiln_router_sessions{replica}` (active sessions homed there),
//! `kiln_router_placements_total{replica,kind}` (kind: new, affine, split, moved,
//! unkeyed), `kiln_router_moves_total`, `kiln_router_retries_total`, `kiln_router_broken_streams_total` and
//! `kiln_router_unplaced_total` (requests that found no healthy replica).

use crate::placer::{PlacementKind, Placer};
use std::fmt::Write;

/// The Prometheus text exposition of `placer`'s state.
pub fn render(placer: &Placer) -> String {
    let mut out = String::new();
    let gauge = |out: &mut String,
                 name: &str,
                 help: &str,
                 value: &dyn Fn(&crate::placer::Replica) -> String| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in placer.replicas() {
            let _ = writeln!(
                out,
                "{name}{{replica=\"{}\"}} {}",
                escape(&r.name),
                value(r)
            );
        }
    };
    gauge(
        &mut out,
        "kiln_router_in_flight",
        "Requests the router has in flight per replica.",
        &|r| r.in_flight.to_string(),
    );
    gauge(
        &mut out,
        "kiln_router_replica_up",
        "1 if the replica takes requests, 0 if drained.",
        &|r| u8::from(r.up).to_string(),
    );
    gauge(
        &mut out,
        "kiln_router_sessions",
        "Active sessions homed on the replica.",
        &|r| r.sessions.to_string(),
    );
    let name = "kiln_router_placements_total";
    let _ = writeln!(
        out,
        "# HELP {name} Requests placed, by replica and reason.\n# TYPE {name} counter"
    );
    for r in placer.replicas() {
        for (kind, count) in PlacementKind::ALL.iter().zip(r.placements) {
            let _ = writeln!(
                out,
                "{name}{{replica=\"{}\",kind=\"{}\"}} {count}",
                escape(&r.name),
                kind.as_str()
            );
        }
    }
    let c = placer.counters;
    for (name, help, value) in [
        (
            "kiln_router_moves_total",
            "Sessions given a different home replica.",
            c.moves,
        ),
        (
            "kiln_router_retries_total",
            "Requests retried on another replica before their first byte.",
            c.retries,
        ),
        (
            "kiln_router_unplaced_total",
            "Requests that found no healthy replica.",
            c.unplaced,
        ),
        (
            "kiln_router_broken_streams_total",
            "Responses a replica broke off after the first byte.",
            c.broken_streams,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    }
    out
}

/// A label value with `\`, `"` and newlines escaped.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{KilnParams, PolicyName};
    use crate::session::SessionKey;

    #[test]
    fn metrics_show_in_flight_placements_and_retries_per_replica() {
        let mut placer = Placer::new(PolicyName::Kiln, KilnParams::default(), 1);
        placer.set_replicas(&["http://a".to_string()], 0);
        placer.place(Some(SessionKey(9)), 0, None).unwrap();
        placer.record_retry();
        let text = render(&placer);
        assert!(
            text.contains("kiln_router_in_flight{replica=\"http://a\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kiln_router_placements_total{replica=\"http://a\",kind=\"new\"} 1"),
            "{text}"
        );
        assert!(text.contains("kiln_router_retries_total 1"), "{text}");
        assert!(
            text.contains("kiln_router_replica_up{replica=\"http://a\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c"), "a\\\"b\\\\c");
    }
}
