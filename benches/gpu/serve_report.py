#!/usr/bin/env python3
"""Summarises benches/gpu/serve_sweep.sh results as a markdown table, one row per point.

    benches/gpu/serve_report.py DIR [DIR...]

Per point: the client's view (kiln bench: TTFT p50/p99, output tok/s per user p50, tok/min
per GPU, cache hit rate, errors); the server's decode steps (steps where every request ran
one generated token; prefill and extend steps are left out), their mean batch (decode
tokens over decode steps), and where the engine thread spent such a step from its
step-time counters (schedule, issue, device wait + logits read-back, sampling + token
hand-out); layer_decode's whole step of the same model at batch c (the forward alone,
logits read back) and its bandwidth floor, the bytes over the copy rate copy_rate.py
measured on the card the run landed on (layer_decode's own floor assumes the H200's 4.30
TB/s); and the engine's overhead, the serving decode
step over that forward. Last, the `kiln bench --replot` arguments that draw every
directory's sweep on one chart.
"""
import json
import re
import sys
from pathlib import Path

# layer_decode's floor denominator (kiln_benches::HBM_BYTES_PER_S).
H200_COPY = 4.30e12
LINE = re.compile(r'^(kiln_[a-z_]+)(?:\{kind="([a-z]+)"\})? ([0-9.e+-]+)$')


def counters(path):
    """Counter values by (name, kind label or None)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = LINE.match(line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def label(d):
    _, layers, tp, kv = d.name.split("-")
    rank = "TP1" if tp == "tp1" else f"TP{tp[2:]} rank"
    return f"{rank}, {layers[1:]} layers, {kv} KV"


def main(dirs):
    print("| config | c | requests | TTFT p50 s | TTFT p99 s | tok/s/user | tok/min/GPU | CHR "
          "| preempt | decode steps | mean batch | decode step ms | sched | issue | device "
          "| sample | forward-only ms | floor ms | step/forward |")
    print("|" + "---|" * 19)
    replot, cards = [], []
    for d in map(Path, dirs):
        rescale = 1.0
        copy_file = d / "copy.json"
        if copy_file.exists() and copy_file.stat().st_size > 0:
            copy = json.loads(copy_file.read_text())
            rescale = H200_COPY / copy["copy_bytes_per_s"]
            cards.append(f"{label(d)}: {copy['gpu']}, copy {copy['copy_bytes_per_s'] / 1e12:.2f} TB/s")
        forward = {}
        if (d / "layer_decode.json").exists():
            for p in json.loads((d / "layer_decode.json").read_text()):
                if p["kind"] == "step":
                    forward[p["batch"]] = p
        benches = sorted(d.glob("bench-c*.json"), key=lambda p: int(p.stem[7:]))
        replot.append(f"--replot '{label(d)}=" + ",".join(map(str, benches)) + "'")
        for bench in benches:
            c = int(bench.stem[7:])
            point = json.loads(bench.read_text())["points"][0]
            before = counters(d / f"metrics-before-c{c}.txt")
            after = counters(d / f"metrics-after-c{c}.txt")
            delta = lambda k, kind=None: after.get((k, kind), 0.0) - before.get((k, kind), 0.0)
            steps = max(delta("kiln_steps_by_kind_total", "decode"), 1.0)
            phase = {k: delta(f"kiln_step_{k}_microseconds_total", "decode") / steps / 1e3
                     for k in ("schedule", "issue", "device", "complete")}
            serving = sum(phase.values())
            batch = (delta("kiln_generation_tokens_total") - point["requests"]) / steps
            ttft, tps = point.get("ttft_s") or {}, point.get("output_tps_per_user") or {}
            fp = forward.get(c)
            fwd = f"{fp['layer_ms']:.2f}" if fp else "-"
            floor = f"{fp['floor_ms'] * rescale:.2f}" if fp else "-"
            ratio = f"{serving / fp['layer_ms']:.2f}" if fp else "-"
            chr_ = point.get("cache_hit_rate")
            print(f"| {label(d)} | {c} | {point['requests']} ({point['errors']} err) "
                  f"| {ttft.get('p50', float('nan')):.3f} | {ttft.get('p99', float('nan')):.3f} "
                  f"| {tps.get('p50', float('nan')):.1f} | {point['tokens_per_min_per_gpu']:.0f} "
                  f"| {'-' if chr_ is None else f'{chr_:.3f}'} "
                  f"| {delta('kiln_preemptions_total'):.0f} | {steps:.0f} | {batch:.1f} "
                  f"| {serving:.2f} | {phase['schedule']:.3f} | {phase['issue']:.3f} "
                  f"| {phase['device']:.3f} | {phase['complete']:.3f} | {fwd} | {floor} "
                  f"| {ratio} |")
    print()
    for card in cards:
        print(f"card: {card}")
    print("chart: kiln bench " + " ".join(replot) + " --plot serve.svg")


if __name__ == "__main__":
    main(sys.argv[1:])
