#!/usr/bin/env bash
# The overlapped schedule against --disable-overlap-schedule, measured through kiln serve at
# Kimi's width (the synthetic model of serve_sweep.sh cut to LAYERS layers): one server each
# way, driven by kiln bench at every concurrency, /metrics after each (step-time counters:
# with overlap the engine thread waits less on the device per step). Run from the repo root
# on the GPU machine after `benches/gpu/run.sh build`:
#
#   benches/gpu/overlap_ab.sh LAYERS KV "CONCURRENCIES" SECONDS SCALE
#   e.g. benches/gpu/overlap_ab.sh 4 bf16 "1 4 16" 10 0.1
#
# Results under $OUT/overlap-L<layers>-<kv>/ (bench-<on|off>-c<C>.json, metrics-<on|off>-c<C>.txt);
# benches/gpu/overlap_report.py summarises.
set -euo pipefail
layers=$1 kv=$2 sweep=$3 duration=$4 scale=$5
out="${OUT:-gpu-results}/overlap-L$layers-$kv"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt" || true
base=(serve --backend cuda --port 8765 --synthetic kimi-k2.6 --layers "$layers" --kv-cache-dtype "$kv")
for mode in on off; do
  args=("${base[@]}")
  if [ "$mode" = off ]; then args+=(--disable-overlap-schedule); fi
  .gpu/kiln "${args[@]}" > "$out/serve-$mode.out" 2> "$out/serve-$mode.log" &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 400); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
  for c in $sweep; do
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" \
      --duration "$duration" --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet \
      --json "$out/bench-$mode-c$c.json" 2>&1 | tee -a "$out/bench-$mode.log"
    curl -s localhost:8765/metrics > "$out/metrics-$mode-c$c.txt"
  done
  kill $pid; wait $pid 2>/dev/null || true
  trap - EXIT
done
