#!/usr/bin/env bash
# On the lent H200 (after the device-wheels install line): the CUDA-graph tests of both attention
# backends and the cross-backend greedy check; then the offline suite (throughput, prefix sharing,
# constrained overhead, ablations) on whichever backend passed, and one batch vs the roofline.
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
timeout "${TEST_S:-230}" python3 -m pytest -q -x -s -p no:cacheprovider tests/gpu/test_cuda_graph.py \
  tests/gpu/test_engine_cuda.py -k "graph_replay or backends_give" 2>&1 | grep -v "^\[transformers\]" \
  | tail -25 | tee "$OUT/tests_gpu.log"
if grep -q " passed" "$OUT/tests_gpu.log" && ! grep -q "failed\|error" "$OUT/tests_gpu.log"; then
  base=flashinfer; other=triton
else
  base=triton; other=flashinfer
fi
echo "base backend: $base" | tee "$OUT/base.txt"
cd benchmarks
timeout "${SUITE_S:-300}" python3 offline.py --mode all --no-hf --budget-s 240 --grace-s 15 \
  --engine-arg attention_backend=$base --num-prompts 256 --input-len 1000 --output-len 1000 \
  --groups 16 --ablation-backends \
  --variant "$other graphs:attention_backend=$other" --variant "overlap off:overlap_schedule=off" \
  --output-file "$OUT/suite.json" 2>&1 | tee "$OUT/suite.log" | grep "^|\|copy band\|command\|scaled"
timeout "${ONE_S:-90}" python3 one_batch.py --backends $base+graph --batches 1 64 256 --reps 5 \
  --output-file "$OUT/one_batch.json" 2>&1 | tee "$OUT/one_batch.log" | grep "copy\|decode\|prefill"
