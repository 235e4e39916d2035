#!/usr/bin/env python3
"""Summarises benches/gpu/serve_sweep.sh results as a markdown table, one row per point.

    benches/gpu/serve_report.py DIR [DIR...]

Per point: the client's view (kiln bench: TTFT p50/p99, output tok/s per user p50, tok/min
per GPU, cache hit rate, errors), the server's (steps, preemptions, and where the engine
thread spent each step from its step-time counters: schedule, issue, device wait + logits
read-back, sampling + token hand-out), the serving step over its forward (issue + device),
and layer_decode's forward alone and bandwidth floor at the same batch, per layer, times
the served layers (embedding and lm_head excluded there).
"""
import json
import sys
from pathlib import Path


def counters(path):
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("kiln_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def main(dirs):
    print("| config | c | requests | TTFT p50 s | TTFT p99 s | tok/s/user | tok/min/GPU | CHR "
          "| steps | preempt | sched ms | issue ms | device ms | sample ms | step/forward "
          "| forward-only ms | floor ms |")
    print("|" + "---|" * 17)
    for d in map(Path, dirs):
        layers = int(d.name.split("-")[1][1:])
        layer = {}
        if (d / "layer_decode.json").exists():
            for p in json.loads((d / "layer_decode.json").read_text()):
                if p["kind"] == "decode":
                    layer[p["batch"]] = p
        for bench in sorted(d.glob("bench-c*.json"), key=lambda p: int(p.stem[7:])):
            c = int(bench.stem[7:])
            point = json.loads(bench.read_text())["points"][0]
            before = counters(d / f"metrics-before-c{c}.txt")
            after = counters(d / f"metrics-after-c{c}.txt")
            delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
            steps = max(delta("kiln_steps_total"), 1.0)
            phase = {k: delta(f"kiln_step_{k}_microseconds_total") / steps / 1e3
                     for k in ("schedule", "issue", "device", "complete")}
            forward = phase["issue"] + phase["device"]
            serving = sum(phase.values())
            ttft, tps = point.get("ttft_s") or {}, point.get("output_tps_per_user") or {}
            lp = layer.get(c)
            fwd = f"{lp['layer_ms'] * layers:.2f}" if lp else "-"
            floor = f"{lp['floor_ms'] * layers:.2f}" if lp else "-"
            chr_ = point.get("cache_hit_rate")
            print(f"| {d.name} | {c} | {point['requests']} ({point['errors']} err) "
                  f"| {ttft.get('p50', float('nan')):.3f} | {ttft.get('p99', float('nan')):.3f} "
                  f"| {tps.get('p50', float('nan')):.1f} | {point['tokens_per_min_per_gpu']:.0f} "
                  f"| {'-' if chr_ is None else f'{chr_:.3f}'} | {steps:.0f} "
                  f"| {delta('kiln_preemptions_total'):.0f} | {phase['schedule']:.3f} "
                  f"| {phase['issue']:.3f} | {phase['device']:.3f} | {phase['complete']:.3f} "
                  f"| {serving / forward if forward else float('nan'):.2f} | {fwd} | {floor} |")


if __name__ == "__main__":
    main(sys.argv[1:])
