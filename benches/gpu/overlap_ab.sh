#!/usr/bin/env bash
# The overlapped schedule against --disable-overlap-schedule, and against overlap with decode
# steps replayed from CUDA graphs, measured through kiln serve at Kimi's width (the
# synthetic model of serve_sweep.sh cut to LAYERS layers): one server each way, driven by
# kiln bench at every concurrency, /metrics after each (step-time counters: with overlap the
# engine thread waits less on the device per step, with graphs it issues less). Run from the
# repo root on the GPU machine after `benches/gpu/run.sh build`:
#
#   benches/gpu/overlap_ab.sh LAYERS KV "CONCURRENCIES" SECONDS SCALE
#   e.g. benches/gpu/overlap_ab.sh 4 bf16 "1 4 16" 10 0.1
#
# Each server first runs a discarded pass at every concurrency, so kernels the batches'
# shapes need are compiled before the measured pass (a first prefill of a new shape costs
# seconds of NVRTC); CubeCL's compilation log (compile-<mode>.log) shows what still
# compiled during the measured pass.
# Results under $OUT/overlap-L<layers>-<kv>/ (bench-<on|off>-c<C>.json, metrics-<on|off>-c<C>.txt);
# benches/gpu/overlap_report.py summarises.
# BACKEND=cuda-routed (environment) runs kiln on the routed runtime instead of cuda.
# MODES (environment, default "on off") names the servers: on (overlapped), off (waiting),
# graphs (overlapped, --cuda-graph-sizes GRAPH_SIZES, default 1,2,4,8,16,32; needs
# BACKEND=cuda-routed).
set -euo pipefail
layers=$1 kv=$2 sweep=$3 duration=$4 scale=$5
out="${OUT:-gpu-results}/overlap-L$layers-$kv"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt" || true
base=(serve --backend "${BACKEND:-cuda}" --port 8765 --synthetic kimi-k2.6 --layers "$layers" --kv-cache-dtype "$kv")
for mode in ${MODES:-on off}; do
  args=("${base[@]}")
  case $mode in
    off) args+=(--disable-overlap-schedule) ;;
    graphs) args+=(--cuda-graph-sizes "${GRAPH_SIZES:-1,2,4,8,16,32}") ;;
  esac
  printf '[compilation.logger]\nlevel = "basic"\nfile = "%s"\n' "$(cd "$out" && pwd)/compile-$mode.log" > cubecl.toml
  .gpu/kiln "${args[@]}" > "$out/serve-$mode.out" 2> "$out/serve-$mode.log" &
  pid=$!
  trap 'kill $pid 2>/dev/null || true; rm -f cubecl.toml' EXIT
  for _ in $(seq 400); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
  for c in $sweep; do
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" --duration "$duration" \
      --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet > /dev/null 2>&1
  done
  curl -s localhost:8765/metrics > "$out/metrics-$mode-warm.txt"
  echo "$mode: $(wc -l < "$out/compile-$mode.log") compilation log lines after the warm-up" \
    | tee -a "$out/compiled.txt"
  for c in $sweep; do
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" \
      --duration "$duration" --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet \
      --json "$out/bench-$mode-c$c.json" 2>&1 | tee -a "$out/bench-$mode.log"
    curl -s localhost:8765/metrics > "$out/metrics-$mode-c$c.txt"
  done
  kill $pid; wait $pid 2>/dev/null || true
  echo "$mode: $(wc -l < "$out/compile-$mode.log") after the measured pass" | tee -a "$out/compiled.txt"
  trap - EXIT
done
rm -f cubecl.toml
