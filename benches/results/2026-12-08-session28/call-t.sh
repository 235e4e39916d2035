mkdir -p .gpu && tar xJf target/gpu.txz -C .gpu
export CUDA_HOME=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u
timeout 420 benches/gpu/tier_sweep.sh 4 bf16 1600 32 "4 8" 30 0.5 > $OUT/tier.log 2>&1; echo tier rc $?
python3 benches/gpu/tier_report.py $OUT/tier-L4-bf16-p1600 2>&1 | tee $OUT/tier_report.txt
grep -h -E "^kiln_(host|kv|prefix|preempt)" $OUT/tier-L4-bf16-p1600/metrics-*-c8.txt | head -40
tar czf $OUT/tier.tgz -C $OUT tier-L4-bf16-p1600 && rm -rf $OUT/tier-L4-bf16-p1600
date -u
