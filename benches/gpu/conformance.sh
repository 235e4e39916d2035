#!/usr/bin/env bash
# The conformance suite and `kiln check` on CUDA.
#
#   benches/gpu/conformance.sh build   # on the CPU machine: CUDA-only binaries into .gpu/
#   benches/gpu/conformance.sh run     # on the GPU machine, from the repo root: runs them,
#                                      # logs and JSON into $OUT (or gpu-results/)
#
# Built with `--no-default-features --features cuda` so the binaries need neither Vulkan
# nor a display on the GPU machine; a separate target dir keeps the wgpu build intact.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  build)
    export CARGO_TARGET_DIR=target/cuda CUDARC_CUDA_VERSION=13000
    cargo build --release -p kiln --no-default-features --features cuda
    exe=$(cargo test --release -p kiln-conformance --no-default-features --features cuda \
            --test conformance --no-run 2>&1 | sed -n 's/.*Executable.*(\(.*\)).*/\1/p' | tail -1)
    mkdir -p .gpu
    cp target/cuda/release/kiln .gpu/kiln
    cp "$exe" .gpu/conformance
    strip .gpu/kiln .gpu/conformance
    ls -la .gpu
    ;;
  run)
    out="${OUT:-gpu-results}"
    mkdir -p "$out"
    export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
    .gpu/kiln info --backend cuda | tee "$out/info.txt"
    set +e
    .gpu/conformance --test-threads 4 2>&1 | tee "$out/conformance.log"
    tests=${PIPESTATUS[0]}
    .gpu/kiln check --backend cuda --json "$out/check.json" 2>&1 | tee "$out/check.log"
    check=${PIPESTATUS[0]}
    set -e
    grep -E "^test result" "$out/conformance.log" || true
    echo "conformance exit $tests, check exit $check"
    [ "$tests" -eq 0 ] && [ "$check" -eq 0 ]
    ;;
  *)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
