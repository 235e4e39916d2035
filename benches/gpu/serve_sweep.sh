#!/usr/bin/env bash
# kiln serve at Kimi's width on one GPU, measured through its HTTP API: a synthetic model
# (weights generated on the device) cut to LAYERS layers, optionally one rank of TP, driven
# by kiln bench's coding-agent sessions one concurrency at a time; each point's /metrics
# before and after (step-time counters by step kind), then, with the server gone, the
# forward alone of the same model at the same batches from layer_decode --served-layers
# (whole steps, logits read back, and their bandwidth floor), and the card's copy rate. Run from the repo root on
# the GPU machine after `benches/gpu/run.sh build`, inside one device call:
#
#   benches/gpu/serve_sweep.sh LAYERS TP KV "CONCURRENCIES" SECONDS SCALE
#   e.g. benches/gpu/serve_sweep.sh 4 1 bf16 "1 4 16" 40 0.1
#
# Results under $OUT/serve-L<layers>-tp<T>-<kv>/; benches/gpu/serve_report.py summarises.
# BACKEND=cuda-routed (environment) runs kiln on the routed runtime instead of cuda.
set -euo pipefail
layers=$1 tp=$2 kv=$3 sweep=$4 duration=$5 scale=$6
out="${OUT:-gpu-results}/serve-L$layers-tp$tp-$kv"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:${LD_LIBRARY_PATH:-}"
# The card this call landed on and its copy rate: the floors' denominator.
python3 benches/gpu/copy_rate.py > "$out/copy.json" || true
args=(serve --backend "${BACKEND:-cuda}" --port 8765 --synthetic kimi-k2.6 --layers "$layers" --kv-cache-dtype "$kv")
if [ "$tp" != 1 ]; then args+=(--tp-rank-of "$tp"); fi
start=$(date +%s)
.gpu/kiln "${args[@]}" > "$out/serve.out" 2> "$out/serve.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 400); do curl -sf localhost:8765/health >/dev/null && break; sleep 0.5; done
echo "serving after $(( $(date +%s) - start )) s" | tee "$out/startup.txt"
for c in $sweep; do
  curl -s localhost:8765/metrics > "$out/metrics-before-c$c.txt"
  .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "$c" --duration "$duration" \
    --scale "$scale" --think-scale 0 --max-token-id 40000 --quiet \
    --json "$out/bench-c$c.json" 2>&1 | tee "$out/bench-c$c.log"
  curl -s localhost:8765/metrics > "$out/metrics-after-c$c.txt"
done
kill $pid; wait $pid 2>/dev/null || true
trap - EXIT
batches=$(echo $sweep | tr ' ' ',')
ld=(--backend "${BACKEND:-cuda}" --kv "$kv" --served-layers "$layers" --batches "$batches" --prefill 0 --reps 5
  --contexts "$(python3 -c "print(int(100000*$scale))")" --json "$out/layer_decode.json")
if [ "$tp" != 1 ]; then ld+=(--tp-rank-of "$tp"); fi
.gpu/layer_decode "${ld[@]}" 2>&1 | tee "$out/layer_decode.log" || true
