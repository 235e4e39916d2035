#!/usr/bin/env bash
# kiln on CUDA: the kernel conformance suite, the HF-conformance tests of the model, the
# decode graphs' tests, `kiln check`, and the benchmarks (bf16 GEMM against cuBLAS, Kimi-K2 per layer).
#
#   benches/gpu/run.sh build   # on the CPU machine: CUDA-only binaries into .gpu/
#   benches/gpu/run.sh run     # on the GPU machine, from the repo root: runs them,
#                                      # logs and JSON into $OUT (or gpu-results/)
#   benches/gpu/run.sh bench   # the benchmarks alone
#   benches/gpu/run.sh serve   # kiln serve (embedded model) on CUDA: a chat completion,
#                                      # then a kiln bench sweep against it
#
# Built with `--no-default-features --features cuda` so the binaries need neither Vulkan
# nor a display on the GPU machine; a separate target dir keeps the wgpu build intact.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-results}"
test_exe() { # package, test target -> path of the built test executable
  cargo test --release -p "$1" --no-default-features --features cuda --test "$2" --no-run 2>&1 \
    | sed -n 's/.*Executable.*(\(.*\)).*/\1/p' | tail -1
}
bench() {
  export LD_LIBRARY_PATH="${CUDA_HOME:-/usr/local/cuda}/lib64:${LD_LIBRARY_PATH:-}"
  .gpu/gemm_peer "$out/gemm_peer.json" 2>&1 | tee "$out/gemm_peer.log"
  .gpu/gemm_decode "$out/gemm_decode.json" 2>&1 | tee "$out/gemm_decode.log"
  .gpu/gemm_decode "$out/gemm_tiled.json" 64,256,4096,16384 2>&1 | tee "$out/gemm_tiled.log"
  .gpu/moe_grouped "$out/moe_grouped.json" 2>&1 | tee "$out/moe_grouped.log"
  .gpu/mla_decode "$out/mla_decode.json" 2>&1 | tee "$out/mla_decode.log"
  python3 benches/gpu/mla_peer.py "$out/mla_peer.json" "$out/mla_decode.json" 2>&1 | tee "$out/mla_peer.log"
  .gpu/mla_prefill "$out/mla_prefill.json" 2>&1 | tee "$out/mla_prefill.log"
  python3 benches/gpu/mla_peer.py prefill "$out/mla_peer_prefill.json" "$out/mla_prefill.json" 2>&1 \
    | tee "$out/mla_peer_prefill.log"
  .gpu/tree_verify "$out/tree_verify.json" 2>&1 | tee "$out/tree_verify.log"
  .gpu/sample "$out/sample.json" 2>&1 | tee "$out/sample.log"
  python3 benches/gpu/sample_peer.py "$out/sample_peer.json" "$out/sample.json" 2>&1 | tee "$out/sample_peer.log"
  .gpu/layer_decode --backend cuda --json "$out/layer_decode.json" 2>&1 | tee "$out/layer_decode.log"
  .gpu/launch_cost --json "$out/launch_cost.json" 2>&1 | tee "$out/launch_cost.log"
}
case "${1:-}" in
  build)
    export CARGO_TARGET_DIR=target/cuda CUDARC_CUDA_VERSION=13000
    cargo build --release -p kiln-cli -p kiln-benches --no-default-features --features cuda
    mkdir -p .gpu
    cp "$(test_exe kiln-conformance conformance)" .gpu/conformance
    cp "$(test_exe kiln hf_conformance)" .gpu/hf_conformance
    cp "$(test_exe kiln graphs)" .gpu/graphs
    cp target/cuda/release/kiln target/cuda/release/layer_decode target/cuda/release/gemm_peer \
      target/cuda/release/gemm_decode target/cuda/release/moe_grouped \
      target/cuda/release/mla_decode target/cuda/release/mla_prefill target/cuda/release/tree_verify target/cuda/release/sample \
      target/cuda/release/launch_cost .gpu/
    strip .gpu/*
    ls -la .gpu
    ;;
  run)
    mkdir -p "$out"
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" KILN_FIXTURES="$PWD/tests/fixtures/hf"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    set +e
    .gpu/conformance --test-threads 4 2>&1 | tee "$out/conformance.log"
    kernels=${PIPESTATUS[0]}
    .gpu/hf_conformance --nocapture --test-threads 1 2>&1 | tee "$out/hf_conformance.log"
    model=${PIPESTATUS[0]}
    .gpu/graphs --test-threads 1 2>&1 | tee "$out/graphs.log"
    graphs=${PIPESTATUS[0]}
    .gpu/kiln check --backend cuda --json "$out/check.json" 2>&1 | tee "$out/check.log"
    check=${PIPESTATUS[0]}
    .gpu/kiln generate --backend cuda --model tests/fixtures/hf/tiny-kimi \
      --prompt "kiln serves coding agents" --max-tokens 32 --ids 2>&1 | tee "$out/generate.log"
    set -e
    grep -E "^test result" "$out/conformance.log" "$out/hf_conformance.log" "$out/graphs.log" || true
    echo "conformance exit $kernels, hf_conformance exit $model, graphs exit $graphs, check exit $check"
    [ "$kernels" -eq 0 ] && [ "$model" -eq 0 ] && [ "$graphs" -eq 0 ] && [ "$check" -eq 0 ]
    ;;
  bench)
    mkdir -p "$out"
    bench
    ;;
  serve)
    mkdir -p "$out"
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    .gpu/kiln serve --backend cuda --port 8765 > "$out/serve.out" 2> "$out/serve.log" &
    pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    for _ in $(seq 180); do curl -sf localhost:8765/health >/dev/null && break; sleep 1; done
    curl -s localhost:8765/v1/chat/completions -H 'content-type: application/json' \
      -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}' | tee "$out/chat.json"
    echo
    .gpu/kiln bench --url http://127.0.0.1:8765 --sweep "${SWEEP:-1,4,16,64}" \
      --duration "${DURATION:-20}" --scale "${SCALE:-0.03}" --think-scale 0 \
      --json "$out/bench.json" --plot "$out/pareto.svg" 2>&1 | tee "$out/bench.log"
    curl -s localhost:8765/metrics > "$out/metrics.txt"
    grep -E "^kiln_(cache_hit_rate|prompt_tokens_total|cached_tokens_total|generation_tokens_total|preemptions_total|steps_total)" "$out/metrics.txt"
    ;;
  *)
    echo "usage: $0 build|run|bench|serve" >&2
    exit 2
    ;;
esac
