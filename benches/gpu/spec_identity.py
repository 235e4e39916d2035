#!/usr/bin/env python3
"""Speculative decoding on CUDA, checked for exactly what it must not change: greedy
outputs over HTTP with and without drafts, and how drafts fare on traffic.

For each server configuration (speculation off, n-gram chains, suffix trees; drafting at
every step with --draft-policy fixed, so the most drafts are checked), starts
`.gpu/kiln serve --backend cuda` on the embedded model (random weights: what its
acceptance says is about this model's loops, not about a trained model's), sends the same
greedy /generate requests together (prompts the drafters get right and wrong), and
compares every output with speculation off's (run twice: the second run is the control for
outputs that move with how batches happened to form); reports identical outputs, drafted and
accepted tokens and the accept length (completion tokens over spec_verify_ct).

    benches/gpu/spec_identity.py OUT_JSON CONCURRENCY [SERVER ARGS...]
    e.g. benches/gpu/spec_identity.py identity-c1-exact.json 1 --precision exact
"""
import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PORT = 8766
CONFIGS = {
    "off": [],
    # The control: batches form by timing, and numerics may vary with a batch's shape.
    "off again": [],
    "ngram": ["--speculative", "ngram", "--max-draft-tokens", "8", "--draft-policy", "fixed"],
    "suffix": ["--speculative", "suffix", "--max-draft-tokens", "8", "--draft-policy", "fixed"],
}


def prompts():
    out = []
    for i in range(48):
        kind = i % 3
        if kind == 0:  # a repeating pattern: drafts right
            out.append([5 + (t + i) % 6 for t in range(60)])
        elif kind == 1:  # no repeats: drafts from the model's own loops only
            out.append([3 + (t * 37 + i * 11) % 500 for t in range(40)])
        else:  # a quoted span: the drafter follows it
            span = [40 + i] + [41 + (t * 13 + i) % 200 for t in range(20)]
            out.append(span + [7, 8] + span[:3])
    return out


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def run(args, concurrency):
    server = subprocess.Popen([".gpu/kiln", "serve", "--backend", "cuda", "--port", str(PORT)]
                              + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        body = lambda p: {"input_ids": p, "sampling_params": {
            "max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}
        start = time.time()
        with ThreadPoolExecutor(concurrency) as pool:
            outs = list(pool.map(lambda p: post("/generate", body(p)), prompts()))
        seconds = time.time() - start
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics") as r:
            text = r.read().decode()
        return outs, seconds, text
    finally:
        server.terminate()
        server.wait()


def main(path, concurrency, extra):
    results, base = {"concurrency": concurrency, "server_args": extra}, None
    for name, args in CONFIGS.items():
        outs, seconds, text = run(args + extra, concurrency)
        ids = [o["output_ids"] for o in outs]
        base = base or ids
        completion = sum(len(i) for i in ids)
        verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        row = {
            "identical": sum(a == b for a, b in zip(ids, base)),
            "requests": len(ids),
            "first_difference": next(([k, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)]
                                      for k, (a, b) in enumerate(zip(ids, base)) if a != b), None),
            "drafted": metric(text, "kiln_spec_drafted_tokens_total"),
            "accepted": metric(text, "kiln_spec_accepted_tokens_total"),
            "accept_length": completion / verify if verify else None,
            "seconds": round(seconds, 2),
        }
        results[name] = row
        print(name, json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
