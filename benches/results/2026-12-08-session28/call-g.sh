mkdir -p .gpu && tar xJf target/gpu.txz -C .gpu
export CUDA_HOME=/usr/local/cuda KILN_FIXTURES=$PWD/tests/fixtures/hf LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u
timeout 60 .gpu/conformance launcher cache_writes --test-threads 4 > $OUT/conf.log 2>&1; grep -E "^test |test result" $OUT/conf.log | grep -v " ok$"
timeout 150 .gpu/graphs --test-threads 1 > $OUT/graphs.log 2>&1; echo graphs rc $?; grep -E "^test |test result|panicked|differ" $OUT/graphs.log | head -20
date -u
for g in eager graphs; do f=$([ $g = graphs ] && echo --graphs); timeout 120 .gpu/layer_decode --backend cuda-routed --batches 1,32 --contexts 8192,100000 --prefill 0 --reps 7 $f --json $OUT/layer-$g.json > $OUT/layer-$g.log 2>&1; echo "$g rc $?"; grep -E "^decode " $OUT/layer-$g.log; done
date -u
BACKEND=cuda-routed MODES="on graphs" timeout 170 benches/gpu/overlap_ab.sh 4 bf16 "1 16" 8 0.1 > $OUT/ab.log 2>&1; echo ab rc $?
python3 benches/gpu/overlap_report.py $OUT/overlap-L4-bf16 2>&1 | tee $OUT/ab_report.txt
grep -h "recorded a decode" $OUT/overlap-L4-bf16/serve-graphs.log | tail -3
tar czf $OUT/ab.tgz -C $OUT overlap-L4-bf16 && rm -rf $OUT/overlap-L4-bf16
date -u
