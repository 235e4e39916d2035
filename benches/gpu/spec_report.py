#!/usr/bin/env python3
"""Summarises benches/gpu/spec_sweep.sh results: per concurrency, output tok/s per user
(median) with speculation off and at each simulated accept length, the accept length the
bench measured (completion tokens over SGLang's spec_verify_ct), and the speed-up over off.

    benches/gpu/spec_report.py DIR [DIR...]
"""
import json
import sys
from pathlib import Path


def points(path):
    return {p["concurrency"]: p for p in json.loads(path.read_text())["points"]}


def main(dirs):
    print("| config | c | spec | accept length (measured) | tok/s/user | x off | TTFT p50 s |")
    print("|" + "---|" * 7)
    for d in map(Path, dirs):
        off = points(d / "bench-off.json")
        runs = sorted(d.glob("bench-a*.json"), key=lambda p: float(p.stem[7:]))
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


if __name__ == "__main__":
    main(sys.argv[1:])
