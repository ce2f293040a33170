#!/usr/bin/env bash
# One device call on 2 x H200: the TP GPU tests, the TP benchmark (Llama-3-70B shape, TP=2; 8B latency
# at TP 1 and 2), then the offline throughput benchmark on GPU 0 with what time is left.
# Usage (after the device-wheels install line): bash benchmarks/run_h200_tp.sh $OUT
set -u
OUT=${1:-bench_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - START) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
timeout 170 python3 -m pytest -x -q -rs tests/gpu/test_tensor_parallel_cuda.py 2>&1 \
  | tail -30 | tee "$OUT/tp_tests.log"
echo "== tp benchmark ($(left) s left)"
timeout 300 python3 benchmarks/tp.py --config benchmarks/configs/llama-3-70b --tp 2 --num 32 128 \
  --input-len 1000 --output-len 1000 --latency-config benchmarks/configs/llama-3.1-8b \
  --latency-tp 1 2 > "$OUT/tp_bench.log" 2>&1
tail -45 "$OUT/tp_bench.log"
if ! grep -q "output throughput" "$OUT/tp_bench.log"; then
  echo "== tp benchmark again, eager ($(left) s left)"
  timeout 200 python3 benchmarks/tp.py --tp 2 --num 32 --eager --latency-tp 1 2 \
    > "$OUT/tp_bench_eager.log" 2>&1
  tail -45 "$OUT/tp_bench_eager.log"
fi
REM=$(left)
echo "== offline ($REM s left)"
if [ "$REM" -gt 90 ] && [ -z "${NO_OFFLINE:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $((REM - 5)) python3 benchmarks/offline.py --mode offline \
    --num-prompts 256 --hf-num-prompts 64 --hf-compile off --budget-s $((REM - 60)) \
    --grace-s 20 --output-file "$OUT/offline.json" > "$OUT/offline.log" 2>&1
  tail -30 "$OUT/offline.log"
fi
