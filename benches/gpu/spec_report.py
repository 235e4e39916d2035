#!/usr/bin/env python3
"""Summarises benches/gpu/spec_sweep.sh results: per concurrency, output tok/s per user
(median) with speculation off and at each simulated accept length, the accept length the
bench measured (completion tokens over SGLang's spec_verify_ct), and the speed-up over off;
then, where the sweep kept /metrics after each concurrency, what the draft policy decided
in each phase (kiln_spec_policy_steps_total by decision, this phase's steps only, the
warm-up pass's left out).

    benches/gpu/spec_report.py DIR [DIR...]
"""
import json
import re
import sys
from pathlib import Path

DECISIONS = ["draft", "no_gain", "unmeasured", "probe"]


def points(path):
    return {p["concurrency"]: p for p in json.loads(path.read_text())["points"]}


def main(dirs):
    print("| config | c | spec | accept length (measured) | tok/s/user | x off | TTFT p50 s |")
    print("|" + "---|" * 7)
    for d in map(Path, dirs):
        off = points(d / "bench-off.json")
        runs = sorted((p for p in d.glob("bench-a*.json") if re.fullmatch(r"bench-a[\d.]+", p.stem)),
                      key=lambda p: float(p.stem[7:]))
        for c, base in sorted(off.items()):
            base_tps = (base.get("output_tps_per_user") or {}).get("p50")
            for name, p in [("off", base)] + [(f"simulated {r.stem[7:]}", points(r).get(c))
                                              for r in runs]:
                if p is None:
                    continue
                tps = (p.get("output_tps_per_user") or {}).get("p50")
                acc = p.get("accept_len")
                ratio = tps / base_tps if tps and base_tps else float("nan")
                ttft = (p.get("ttft_s") or {}).get("p50", float("nan"))
                print(f"| {d.name} | {c} | {name} | {'-' if acc is None else f'{acc:.2f}'} "
                      f"| {tps or float('nan'):.1f} | {ratio:.2f} | {ttft:.3f} |")
    policy(dirs)


def decisions(path):
    counts = dict.fromkeys(DECISIONS, 0.0)
    for line in path.read_text().splitlines():
        m = re.match(r'kiln_spec_policy_steps_total\{decision="(\w+)"\} (\S+)', line)
        if m:
            counts[m.group(1)] = float(m.group(2))
    return counts


def policy(dirs):
    rows = []
    for d in map(Path, dirs):
        for run in sorted(d.glob("bench-a*.json")):
            m = re.fullmatch(r"bench-(a[\d.]+)", run.stem)
            if not m:
                continue
            phases = sorted(d.glob(f"metrics-{m.group(1)}-c*.txt"),
                            key=lambda p: int(p.stem.rsplit("-c", 1)[1]))
            # Counters are cumulative from the server's start, its warm-up pass included.
            warm = d / f"metrics-{m.group(1)}-warm.txt"
            before = decisions(warm) if warm.exists() else dict.fromkeys(DECISIONS, 0.0)
            for path in phases:
                now = decisions(path)
                c = path.stem.rsplit("-c", 1)[1]
                rows.append((d.name, m.group(1), c, [now[k] - before[k] for k in DECISIONS]))
                before = now
    if rows:
        print()
        print("| config | spec | c | " + " | ".join(DECISIONS) + " |")
        print("|" + "---|" * (3 + len(DECISIONS)))
        for name, spec, c, counts in rows:
            print(f"| {name} | {spec} | {c} | " + " | ".join(f"{v:.0f}" for v in counts) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
