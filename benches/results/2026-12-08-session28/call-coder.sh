mkdir -p .gpu && tar xJf target/coder.txz -C .gpu
export CUDA_HOME=/usr/local/cuda KILN_FIXTURES=$PWD/tests/fixtures/hf LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; date -u
timeout 90 .gpu/hf_conformance coder per_head --test-threads 1 --nocapture > $OUT/hf_coder.log 2>&1; echo hf rc $?; grep -E "^test |test result|panicked" $OUT/hf_coder.log | head -20
P='[BOS]<|im_user|>user<|im_middle|>Write a Python function that reverses a list.<|im_end|><|im_assistant|>assistant<|im_middle|>'
for b in cuda cuda-routed; do for i in 1 2; do timeout 60 .gpu/kiln generate --model engine/assets/kiln-coder --backend $b --prompt "$P" --max-tokens 64 > $OUT/chat-$b-$i.log 2>&1; grep -E "prefill .* tokens in" $OUT/chat-$b-$i.log; timeout 60 .gpu/kiln generate --model engine/assets/kiln-coder --backend $b --prompt "import os" --max-tokens 256 > $OUT/gen-$b-$i.log 2>&1; echo "$b rc $?"; grep -E "prefill .* tokens in" $OUT/gen-$b-$i.log; done; done
head -30 $OUT/gen-cuda-1.log
date -u
