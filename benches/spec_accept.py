#!/usr/bin/env python3
"""Speculative decoding's acceptance on real text: agent turns against a running `kiln serve`
(with `--speculative ngram|suffix`), each a coding agent's read of a source file (a
`read_file` tool call, the file as the tool's result) followed by the model's greedy answer,
which tends to quote it. Prints the tokens drafted and accepted, the verify steps and the
mean accept length (tokens emitted per verify step) from the server's /metrics counters,
and the requests' decode speed.

    kiln serve --port 8000 --speculative suffix &
    python3 benches/spec_accept.py --url http://127.0.0.1:8000 tools/*.py
"""
import argparse
import json
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def counters(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=60).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kiln_") and " " in line and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def turn(path, text):
    call = {"id": "read_file:0", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}
    return [
        {"role": "user", "content": f"Read {path} and show me its first function."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "read_file:0", "content": text},
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-chars", type=int, default=6000, help="of each file, from its start")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    before = counters(args.url)
    tokens, seconds = 0, 0.0
    for path in args.files:
        text = open(path, encoding="utf-8").read()[: args.max_chars]
        start = time.time()
        out = post(args.url + "/v1/chat/completions",
                   {"messages": turn(path, text), "max_tokens": args.max_tokens, "temperature": 0})
        seconds += time.time() - start
        tokens += out["usage"]["completion_tokens"]
    after = counters(args.url)
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafted = diff.get("kiln_spec_drafted_tokens_total", 0)
    accepted = diff.get("kiln_spec_accepted_tokens_total", 0)
    steps = diff.get("kiln_spec_accept_length_count", 0)
    emitted = diff.get("kiln_spec_accept_length_sum", 0)
    print(json.dumps({
        "requests": len(args.files), "completion_tokens": tokens,
        "tokens_per_s_per_request": tokens / seconds if seconds else None,
        "drafted": drafted, "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "verify_steps": steps, "accept_length": emitted / steps if steps else None,
    }, indent=1))


if __name__ == "__main__":
    main()
