#!/usr/bin/env python3
"""Alternated A/B of two builds of one benchmark binary, on the GPU machine.

The H200's figures move between calls and between runs of one call (e.g. +-5% on the fp8
MLA decode, 91-103 us for one bf16 shape), so one run of each build cannot rank them.
This runs `A OUT.json ARGS...` and `B OUT.json ARGS...` alternately for several rounds
(A first in odd rounds, B first in even ones), reads each run's JSON (a list of points),
and prints per point both builds' samples of a timing field, their medians and B / A.

    python3 benches/gpu/ab.py --rounds 4 .gpu/mla_decode_before .gpu/mla_decode \\
        -- bf16 16 8 32768
    python3 benches/gpu/ab.py --rounds 4 --field layer_ms --json-flag=--json \\
        .gpu/layer_decode_before .gpu/layer_decode -- --backend cuda --batches 1,8 --prefill 0

Points are matched by their fields that are not floats (shape, format, ...). The JSON of
every run stays in --out (default $OUT or gpu-results/ab).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys


def run(binary, out_json, args, json_flag):
    cmd = [binary, json_flag, out_json, *args] if json_flag else [binary, out_json, *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(out_json) as f:
        return json.load(f)


def key(point):
    return tuple(sorted((k, v) for k, v in point.items() if not isinstance(v, float)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="build A (the baseline)")
    p.add_argument("b", help="build B")
    p.add_argument("args", nargs="*", help="arguments after the JSON path, after --")
    p.add_argument("--rounds", type=int, default=3, help="runs of each build (default 3)")
    p.add_argument("--field", default="us", help="timing field of a point (default us)")
    p.add_argument("--json-flag", help="pass the JSON path after this flag (layer_decode: --json)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "gpu-results"), "ab"))
    opts = p.parse_args()
    os.makedirs(opts.out, exist_ok=True)

    samples = {}  # point key -> {"a": [...], "b": [...]}
    for r in range(opts.rounds):
        order = [("a", opts.a), ("b", opts.b)]
        if r % 2 == 1:
            order.reverse()
        for side, binary in order:
            out_json = os.path.join(opts.out, f"{side}-{r}.json")
            for point in run(binary, out_json, opts.args, opts.json_flag):
                if opts.field not in point:
                    sys.exit(f"{binary}: a point has no field {opts.field!r}: {point}")
                k = key(point)
                samples.setdefault(k, {"a": [], "b": []})[side].append(point[opts.field])

    print(f"{opts.field}: A = {opts.a}, B = {opts.b}, {opts.rounds} rounds, alternated")
    for k, s in samples.items():
        shape = " ".join(f"{name}={value}" for name, value in k)
        if not s["a"] or not s["b"]:
            print(f"{shape}: only in {'A' if s['a'] else 'B'}")
            continue
        ma, mb = statistics.median(s["a"]), statistics.median(s["b"])
        a_list = " ".join(f"{x:.4g}" for x in s["a"])
        b_list = " ".join(f"{x:.4g}" for x in s["b"])
        print(f"{shape}\n  A {a_list} (median {ma:.4g})\n  B {b_list} (median {mb:.4g})  B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
