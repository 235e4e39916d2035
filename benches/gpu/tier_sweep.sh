#!/usr/bin/env bash
# The host KV tier's curve (issue 30): cache hit rate and TTFT against concurrency with the
# tier off and on, through kiln serve at Kimi's width (the synthetic model of
# serve_sweep.sh cut to LAYERS layers) with a device pool of KV_PAGES pages, small enough
# that the sessions' histories spill out of it as concurrency grows. One server with
# --host-kv-gib 0, one with HOST_GIB; each first runs a discarded pass at the largest
# concurrency with another workload seed (kernels compiled, the pool full of other
# sessions' pages), then kiln bench at every concurrency with /metrics after each. Then
# the host link's pinned copy rate each way (copy_rate.py --host). Run from the repo root
# on the GPU machine after `benches/gpu/run.sh build`:
#
#   benches/gpu/tier_sweep.sh LAYERS KV KV_PAGES HOST_GIB "CONCURRENCIES" SECONDS SCALE
#   e.g. benches/gpu/tier_sweep.sh 4 bf16 1024 16 "1 4 8 16" 20 0.1
#
# Results under $OUT/tier-L<layers>-<kv>-p<pages>/ (bench-<off|on>-c<C>.json,
# metrics-<off|on>-c<C>.txt, copy.json); benches/gpu/tier_report.py summarises and plots.
# BACKEND=cuda-routed (environment) runs kiln on the routed runtime instead of cuda.
set -euo pipefail
layers=$1 kv=$2 pages=$3 host_gib=$4 sweep=$5 duration=$6 scale=$7
out="${OUT:-gpu-results}/tier-L$layers-$kv-p$pages"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt" || true
base=(serve --backend "${BACKEND:-cuda}" --port 8765 --synthetic kimi-k2.6 --layers "$layers" --kv-cache-dtype "$kv"
  --kv-pages "$pages")
largest=$(echo $sweep | tr ' ' '\n' | sort -n | tail -1)
bench=(bench --url http://127.0.0.1:8765 --duration "$duration" --scale "$scale" --think-scale 0
  --max-token-id 40000 --quiet)
for mode in off on; do
  gib=0
  if [ "$mode" = on ]; then gib=$host_gib; fi
  .gpu/kiln "${base[@]}" --host-kv-gib "$gib" > "$out/serve-$mode.out" 2> "$out/serve-$mode.log" &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 400); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
  .gpu/kiln "${bench[@]}" --sweep "$largest" --seed 7 > /dev/null 2>&1
  for c in $sweep; do
    .gpu/kiln "${bench[@]}" --sweep "$c" --json "$out/bench-$mode-c$c.json" 2>&1 \
      | tee -a "$out/bench-$mode.log"
    curl -s localhost:8765/metrics > "$out/metrics-$mode-c$c.txt"
  done
  kill $pid; wait $pid 2>/dev/null || true
  trap - EXIT
done
python3 benches/gpu/copy_rate.py --host > "$out/copy.json" || true
