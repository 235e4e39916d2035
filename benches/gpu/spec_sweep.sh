#!/usr/bin/env bash
# Speculative decoding's speed at a given acceptance, measured through kiln serve at Kimi's
# width: the synthetic model of serve_sweep.sh, one server per accept length in
# simulated-acceptance mode (`--speculative simulate --simulated-accept-len L`: decoding
# requests draft up to DRAFT tokens, as POLICY sizes them, and verification keeps enough
# to emit L a step on average when DRAFT are drafted), and one with speculation off, each
# driven by kiln bench at every concurrency.
# Run from the repo root on the GPU machine after `benches/gpu/run.sh build`:
#
#   benches/gpu/spec_sweep.sh LAYERS KV DRAFT "ACCEPT_LENGTHS" "CONCURRENCIES" SECONDS SCALE [POLICY]
#   e.g. benches/gpu/spec_sweep.sh 4 bf16 5 "2 4 6" "1 4 16" 20 0.1 measured
#
# POLICY is --draft-policy (measured, the default, or fixed: every request drafts DRAFT).
# Results under $OUT/spec-L<layers>-<kv>-d<draft>-<policy>/ (bench-off.json, bench-a<L>.json,
# and per concurrency bench-<name>-c<C>.json with the server's metrics-<name>-c<C>.txt after
# it: counters are cumulative, so a phase's are the difference from the one before);
# benches/gpu/spec_report.py summarises.
# BACKEND=cuda-routed (environment) runs kiln on the routed runtime instead of cuda.
set -euo pipefail
layers=$1 kv=$2 draft=$3 accepts=$4 sweep=$5 duration=$6 scale=$7 policy=${8:-measured}
out="${OUT:-gpu-results}/spec-L$layers-$kv-d$draft-$policy"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt" || true
base=(serve --backend "${BACKEND:-cuda}" --port 8765 --synthetic kimi-k2.6 --layers "$layers" --kv-cache-dtype "$kv")
for a in off $accepts; do
  args=("${base[@]}")
  if [ "$a" != off ]; then
    args+=(--speculative simulate --max-draft-tokens "$draft" --simulated-accept-len "$a"
      --draft-policy "$policy")
  fi
  start=$(date +%s)
  .gpu/kiln "${args[@]}" > "$out/serve-$a.out" 2> "$out/serve-$a.log" &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 400); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
  echo "accept $a: serving after $(( $(date +%s) - start )) s" | tee -a "$out/startup.txt"
  name=$([ "$a" = off ] && echo off || echo "a$a")
  # A discarded pass at every concurrency first: the draft shapes' kernels compile on first
  # use (seconds of NVRTC each), which a cold server would bill to the measured phase.
  for c in $sweep; do
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" --duration "$duration" \
      --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet > /dev/null 2>&1
  done
  curl -s localhost:8765/metrics > "$out/metrics-$name-warm.txt"
  # One kiln bench per concurrency, with /metrics after each (the draft policy's counters
  # by phase), then their points in one file.
  for c in $sweep; do
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" \
      --duration "$duration" --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet \
      --json "$out/bench-$name-c$c.json" 2>&1 | tee -a "$out/bench-$name.log"
    curl -s localhost:8765/metrics > "$out/metrics-$name-c$c.txt"
  done
  python3 - "$out/bench-$name.json" $(for c in $sweep; do echo "$out/bench-$name-c$c.json"; done) <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
merged = dict(runs[0], points=[p for r in runs for p in r["points"]])
json.dump(merged, open(sys.argv[1], "w"), indent=1)
PY
  kill $pid; wait $pid 2>/dev/null || true
  trap - EXIT
done
