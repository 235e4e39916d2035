mkdir -p .gpu && tar xJf target/gpu.txz -C .gpu
export CUDA_HOME=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u
BACKEND=${BACKEND:-cuda} timeout 560 benches/gpu/spec_sweep.sh 4 bf16 5 "1 2 3 4 5 6" "1 4 16" 8 0.1 measured > $OUT/spec.log 2>&1; echo spec rc $?
python3 benches/gpu/spec_report.py $OUT/spec-L4-bf16-d5-measured 2>&1 | tee $OUT/spec_report.txt
tar czf $OUT/spec.tgz -C $OUT spec-L4-bf16-d5-measured && rm -rf $OUT/spec-L4-bf16-d5-measured
date -u
