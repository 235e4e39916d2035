#!/usr/bin/env python3
"""Summarises benches/gpu/tier_sweep.sh: per concurrency, with the host tier off and on,
the cache hit rate (the server's, and the host tier's part of it), TTFT p50/p90, output
tokens/s per user, and the bytes the tier copied each way over the point (from /metrics;
counters are cumulative, so a point's are the difference from the one before), against
the pinned copy rate each way. Prints a markdown table; draws hit rate and TTFT against
concurrency to DIR/tier.png when matplotlib is installed.

    python3 benches/gpu/tier_report.py $OUT/tier-L4-bf16-p1024
"""
import glob
import json
import os
import re
import sys


def counter(path, name):
    with open(path) as f:
        for line in f:
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def series(root, mode):
    rows, before = [], (0.0, 0.0)
    files = glob.glob(os.path.join(root, f"bench-{mode}-c*.json"))
    for path in sorted(files, key=lambda p: int(re.search(r"-c(\d+)\.json$", p).group(1))):
        c = int(re.search(r"-c(\d+)\.json$", path).group(1))
        with open(path) as f:
            p = json.load(f)["points"][0]
        metrics = os.path.join(root, f"metrics-{mode}-c{c}.txt")
        now = (counter(metrics, "kiln_kv_bytes_to_host_total"),
               counter(metrics, "kiln_kv_bytes_to_device_total"))
        ttft = p.get("ttft_s") or {}
        tps = p.get("output_tps_per_user") or {}
        rows.append({
            "c": c,
            "hit": p.get("server_cache_hit_rate"),
            "host_hit": p.get("server_host_hit_rate"),
            "ttft_p50": ttft.get("p50"),
            "ttft_p90": ttft.get("p90"),
            "tps": tps.get("p50"),
            "to_host": now[0] - before[0],
            "to_device": now[1] - before[1],
            "elapsed": p.get("elapsed_s") or 1.0,
        })
        before = now
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    root = sys.argv[1]
    copy = {}
    if os.path.exists(os.path.join(root, "copy.json")):
        with open(os.path.join(root, "copy.json")) as f:
            copy = json.load(f)
    runs = {mode: series(root, mode) for mode in ("off", "on")}
    print("| c | tier | hit rate (host part) | TTFT p50 / p90 s | tok/s/user p50 | GB to host / to device (GB/s) |")
    print("|---|---|---|---|---|---|")
    for mode, rows in runs.items():
        for r in rows:
            gb = f"{r['to_host'] / 1e9:.2f} / {r['to_device'] / 1e9:.2f} " \
                 f"({r['to_host'] / r['elapsed'] / 1e9:.2f} / {r['to_device'] / r['elapsed'] / 1e9:.2f})"
            print(f"| {r['c']} | {mode} | {fmt(r['hit'], '.3f')} ({fmt(r['host_hit'], '.3f')}) | "
                  f"{fmt(r['ttft_p50'], '.3f')} / {fmt(r['ttft_p90'], '.3f')} | {fmt(r['tps'], '.1f')} | {gb} |")
    if copy:
        print(f"\npinned copy on {copy.get('gpu')}: host to device "
              f"{copy.get('host_to_device_bytes_per_s', 0) / 1e9:.1f} GB/s, device to host "
              f"{copy.get('device_to_host_bytes_per_s', 0) / 1e9:.1f} GB/s")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, (hit, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, rows in runs.items():
        cs = [r["c"] for r in rows]
        hit.plot(cs, [r["hit"] or 0 for r in rows], marker="o", label=f"host tier {mode}")
        ttft.plot(cs, [r["ttft_p50"] or 0 for r in rows], marker="o", label=f"host tier {mode}")
    hit.set(xlabel="concurrent sessions", ylabel="cache hit rate", ylim=(0, 1), xscale="log")
    ttft.set(xlabel="concurrent sessions", ylabel="TTFT p50 (s)", xscale="log", yscale="log")
    hit.legend()
    ttft.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(root, "tier.png"), dpi=120)
    print(f"plot: {os.path.join(root, 'tier.png')}")


if __name__ == "__main__":
    main()
