#!/usr/bin/env python3
"""Summarises benches/gpu/overlap_ab.sh results: per concurrency, output tok/s per user
(p50) and TTFT p50 of each server (overlapped, waiting, overlapped with CUDA graphs), the
ratio to the waiting server's (else the overlapped one's), and from /metrics
the decode steps' engine-thread time per step (planning, issuing, waiting on the device,
completing; counters are cumulative, so each concurrency's phase is the difference from
the one before) and the steps overlapped.

    benches/gpu/overlap_report.py DIR
"""
import json
import re
import sys
from pathlib import Path

PHASES = ["schedule", "issue", "device", "complete"]
NAMES = {"on": "overlapped", "off": "waiting", "graphs": "overlapped, graphs"}


def metrics(path):
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r'kiln_step_(\w+)_microseconds_total\{kind="decode"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r'kiln_steps_by_kind_total\{kind="decode"\} (\S+)', line)
        if m:
            out["steps"] = float(m.group(1))
        m = re.match(r"kiln_overlapped_steps_total (\S+)", line)
        if m:
            out["overlapped"] = float(m.group(1))
    return out


def main(d):
    d = Path(d)
    modes = [m for m in NAMES if any(d.glob(f"bench-{m}-c*.json"))]
    base_mode = "off" if "off" in modes else modes[0]
    print(f"| c | schedule | tok/s/user | x {NAMES[base_mode]} | TTFT p50 s "
          "| decode step us: plan / issue / wait / complete | overlapped steps |")
    print("|" + "---|" * 7)
    rows = {}
    for mode in modes:
        # Counters are cumulative from the server's start, its warm-up pass included.
        warm = d / f"metrics-{mode}-warm.txt"
        before = metrics(warm) if warm.exists() else {}
        for path in sorted(d.glob(f"bench-{mode}-c*.json"), key=lambda p: int(p.stem.split("-c")[1])):
            c = int(path.stem.split("-c")[1])
            p = json.loads(path.read_text())["points"][0]
            after = metrics(d / f"metrics-{mode}-c{c}.txt")
            delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
            before = after
            rows[(c, mode)] = (p, delta)
    for c in sorted({c for c, _ in rows}):
        base = rows.get((c, base_mode), ({}, {}))[0]
        base_tps = (base.get("output_tps_per_user") or {}).get("p50")
        for mode in modes:
            if (c, mode) not in rows:
                continue
            p, m = rows[(c, mode)]
            tps = (p.get("output_tps_per_user") or {}).get("p50") or float("nan")
            ratio = tps / base_tps if base_tps else float("nan")
            ttft = (p.get("ttft_s") or {}).get("p50", float("nan"))
            steps = m.get("steps") or float("nan")
            per = " / ".join(f"{m.get(k, float('nan')) / steps:.0f}" for k in PHASES)
            print(f"| {c} | {NAMES[mode]} | {tps:.1f} | {ratio:.2f} "
                  f"| {ttft:.3f} | {per} | {m.get('overlapped', 0):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
