#!/usr/bin/env bash
# On the lent H200 (after the device-wheels install line): the CUDA engine tests (fused kernels vs
# HF), overlap scheduling off vs on in the scheduler loop, and offline throughput.
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
cd benchmarks
for o in off on; do
  timeout "${SCHED_S:-90}" python3 profile_step.py scheduler --num-prompts 256 --output-len 200 \
    --overlap $o 2>&1 | tee "$OUT/sched_overlap_$o.log" | grep -v "^\[transformers\]" | tail -7
done
timeout "${OFFLINE_S:-150}" python3 offline.py --mode offline --no-hf --num-prompts 256 \
  --input-len 1000 --output-len 1000 --output-file "$OUT/offline.json" 2>&1 | tee "$OUT/offline.log" | grep "^|\|copy band"
cd ..
timeout "${TEST_S:-200}" python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_cuda.py \
  -k "fp32 or triton" 2>&1 | tail -15 | tee "$OUT/tests_gpu.log"
