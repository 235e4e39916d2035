#!/usr/bin/env python3
"""A host hit's TTFT against a device hit's and a recompute's, prefix by prefix (issue 30's
"a host hit's TTFT within 1.5x of a device hit's for the same prefix length plus the copy
time at the measured bandwidth").

Starts `kiln serve` with the given arguments (a device pool small enough that a few
prefixes of the longest length spill it, and a host tier), then for every prefix length L,
REPEATS times with a fresh random prefix:
  1. the prefix and one more token: a recompute (nothing cached);
  2. the prefix and another token: a device hit (the prefix's whole pages cached);
  3. distinct filler prompts of L tokens until the pool has turned over (1.5 pools' worth):
     the prefix's pages are evicted to the host tier;
  4. the prefix and a third token: a host hit, checked in /metrics (host-cached tokens rose
     by the prefix's whole pages), with the bytes copied back.
Each request asks for one token, so its latency is its time to first token. The copy time
is the bytes copied to the device over --link-gbps (the pinned copy rate measured in the
same call: `benches/gpu/copy_rate.py --host`). Prints a table and writes every sample.

    benches/gpu/tier_ttft.py OUT_JSON "LENGTHS" REPEATS LINK_GBPS [SERVER ARGS...]
    e.g. benches/gpu/tier_ttft.py tier_ttft.json "4096 16384 65536" 3 55.5 \\
        --backend cuda --synthetic kimi-k2.6 --layers 4 --kv-pages 2048 --host-kv-gib 16

KILN (environment) names the binary (default .gpu/kiln); prompts draw token ids below
MAX_TOKEN_ID (environment, default 40000: within every model's vocabulary but the tiny
random one's, which takes 500).
"""
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

PORT = 8767


def post(body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/generate", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - start, out["meta_info"]["cached_tokens"]


def first_token(ids):
    """Seconds to the first (only) token of a greedy request for `ids`, and its cached tokens."""
    return post({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0,
                                                        "ignore_eos": True}})


def metrics():
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kiln_") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def wait_ready(server):
    for _ in range(1200):
        if server.poll() is not None:
            sys.exit(f"kiln serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit("kiln serve did not become ready")


def measure(rng, length, page, pool_tokens, vocab):
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefix = draw(length)
    whole = length // page * page
    cold, cached_cold = first_token(prefix + draw(1))
    device, cached_device = first_token(prefix + draw(1))
    before = metrics()
    filled = 0
    while filled < 1.5 * pool_tokens:
        first_token(draw(length))
        filled += length
    turned = metrics()
    mid = turned["kiln_host_cached_tokens_total"]
    host, cached_host = first_token(prefix + draw(1))
    after = metrics()
    return {
        "length": length,
        "cold_s": cold,
        "device_s": device,
        "host_s": host,
        "cached": [cached_cold, cached_device, cached_host],
        "host_tokens": after["kiln_host_cached_tokens_total"] - mid,
        "bytes_to_device": after["kiln_kv_bytes_to_device_total"]
        - turned["kiln_kv_bytes_to_device_total"],
        "pages_to_host_while_filling": turned["kiln_kv_pages_to_host_total"]
        - before["kiln_kv_pages_to_host_total"],
        "whole_pages_tokens": whole,
    }


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    out_path, lengths, repeats, link_gbps = sys.argv[1:5]
    lengths = [int(n) for n in lengths.split()]
    repeats, link_gbps = int(repeats), float(link_gbps)
    server_args = sys.argv[5:]
    page = 64
    if "--page-size" in server_args:
        page = int(server_args[server_args.index("--page-size") + 1])
    vocab = int(os.environ.get("MAX_TOKEN_ID", "40000"))
    kiln = os.environ.get("KILN", ".gpu/kiln")
    log = open(out_path + ".serve.log", "w")
    server = subprocess.Popen([kiln, "serve", "--port", str(PORT), *server_args],
                              stdout=log, stderr=log)
    try:
        wait_ready(server)
        pool_tokens = metrics()["kiln_kv_total_pages"] * page
        rng = random.Random(7)
        # Kernels compile on first use: one unmeasured round at the shortest length.
        measure(rng, lengths[0], page, pool_tokens, vocab)
        samples = [measure(rng, n, page, pool_tokens, vocab)
                   for n in lengths for _ in range(repeats)]
    finally:
        server.terminate()
        server.wait()
    rows = []
    print("| prefix | recompute ms | device hit ms | host hit ms | copied MB | copy ms "
          "| host / (device + copy) | host hits |")
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:
        s = [x for x in samples if x["length"] == n]
        med = lambda k: statistics.median(x[k] for x in s)  # noqa: E731
        copy_s = med("bytes_to_device") / (link_gbps * 1e9)
        ratio = med("host_s") / (med("device_s") + copy_s)
        hits = sum(x["host_tokens"] >= x["whole_pages_tokens"] > 0 for x in s)
        rows.append({"length": n, "recompute_s": med("cold_s"), "device_s": med("device_s"),
                     "host_s": med("host_s"), "copy_s": copy_s, "ratio": ratio,
                     "host_hits": hits, "repeats": len(s)})
        print(f"| {n} | {med('cold_s') * 1e3:.1f} | {med('device_s') * 1e3:.1f} "
              f"| {med('host_s') * 1e3:.1f} | {med('bytes_to_device') / 1e6:.1f} "
              f"| {copy_s * 1e3:.2f} | {ratio:.2f} | {hits}/{len(s)} |")
    with open(out_path, "w") as f:
        json.dump({"server_args": server_args, "link_gbps": link_gbps, "page": page,
                   "rows": rows, "samples": samples}, f, indent=1)
    if any(r["host_hits"] < r["repeats"] for r in rows):
        sys.exit("some host-tier requests were not host hits (see the samples)")


if __name__ == "__main__":
    main()
