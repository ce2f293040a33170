#!/usr/bin/env bash
# Small-batch decode on one H200 (one device call, < 600 s), after the device-wheels install line:
#   bash benchmarks/run_h200_small.sh small   # decode-kernel GPU tests; small batches in CUDA graphs
#                                             # per split count; step profiles at batch 1 and 64;
#                                             # one batch vs the roofline; constrained batch 32
#                                             # with the scheduler's mask-fill figures
#   bash benchmarks/run_h200_small.sh mixed   # GPU tests (decode kernel, backends incl. a mixed
#                                             # step, shared prefix); constrained batch 32 (mask
#                                             # fill); 8B TP=1, 128 concurrent, mixed chunk off / on
#   bash benchmarks/run_h200_small.sh offline # 8B TP=1 128 concurrent, mixed on; offline
#                                             # N x 1000/1000 (N=${NUM:-512}), mixed off / on
#   bash benchmarks/run_h200_small.sh verify  # the first steps of a mixed run; constrained batch
#                                             # 32 (mask fill); 8B TP=1 128 concurrent, mixed on
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -s -p no:cacheprovider"
case "${1:-}" in
  small)
    timeout 120 $PYTEST tests/gpu/test_kernels_cuda.py tests/gpu/test_shared_prefix_cuda.py 2>&1 \
      | tail -4 | tee "$OUT/kernels.log"
    timeout 120 python3 benchmarks/kernel_bench.py --small-decode 2>&1 | tee "$OUT/small.log"
    cd benchmarks
    timeout 120 python3 profile_step.py runner --batches 1 64 --rows 16 2>&1 \
      | tee "$OUT/profile.log" | grep -v "^\[transformers\]"
    timeout 120 python3 one_batch.py --backends triton+graph --batches 1 8 64 256 \
      --output-file "$OUT/one_batch.json" 2>&1 | tee "$OUT/one_batch.log" | grep -v "^\[transf"
    timeout "${CON_S:-120}" python3 offline.py --mode constrained --no-hf \
      --output-file "$OUT/constrained.json" 2>&1 | tee "$OUT/constrained.log" | grep "^|"
    ;;
  mixed)
    timeout 240 $PYTEST tests/gpu/test_kernels_cuda.py tests/gpu/test_attention_backends.py \
      tests/gpu/test_shared_prefix_cuda.py 2>&1 | tail -3 | tee "$OUT/tests.log"
    cd benchmarks
    timeout "${CON_S:-120}" python3 offline.py --mode constrained --no-hf \
      --output-file "$OUT/constrained.json" 2>&1 | tee "$OUT/constrained.log" | grep "^|"
    for m in false true; do
      timeout 150 python3 tp.py --config configs/llama-3.1-8b --tp 1 --num 128 --latency-tp \
        --engine-arg enable_mixed_chunk=$m 2>&1 | tee "$OUT/tp1_mixed_$m.log" | grep "^|\|^\*\*"
    done
    ;;
  offline)
    cd benchmarks
    timeout 150 python3 tp.py --config configs/llama-3.1-8b --tp 1 --num 128 --latency-tp \
      --engine-arg enable_mixed_chunk=true 2>&1 | tee "$OUT/tp1_mixed_true.log" | grep "^| 128"
    big="--engine-arg max_running_requests=384 --engine-arg cuda_graph_max_bs=384"
    for m in false true; do
      timeout "${OFF_S:-200}" python3 offline.py --mode offline --num-prompts "${NUM:-512}" --no-hf \
        $big --engine-arg enable_mixed_chunk=$m --output-file "$OUT/offline_$m.json" 2>&1 \
        | tee "$OUT/offline_$m.log" | grep "^|\|copy band"
    done
    ;;
  verify)
    cd benchmarks
    timeout 100 python3 profile_step.py scheduler --num-prompts 128 --input-len 1000 \
      --output-len 64 --max-running 128 --mixed 2>&1 | grep -A18 "^first steps" | head -18
    timeout "${CON_S:-120}" python3 offline.py --mode constrained --no-hf \
      --output-file "$OUT/constrained.json" 2>&1 | tee "$OUT/constrained.log" | grep "^| constr"
    timeout 150 python3 tp.py --config configs/llama-3.1-8b --tp 1 --num 128 --latency-tp \
      --engine-arg enable_mixed_chunk=true 2>&1 | tee "$OUT/tp1_mixed_true.log" | grep "^| 128"
    ;;
  *) echo "usage: $0 small|mixed|offline|verify" >&2; exit 2 ;;
esac
