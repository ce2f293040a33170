#!/usr/bin/env bash
# Small-batch decode on one H200 (one device call, < 600 s), after the device-wheels install line:
#   bash benchmarks/run_h200_small.sh small   # decode-kernel GPU tests; small batches in CUDA graphs
#                                             # per split count; step profiles at batch 1 and 64;
#                                             # one batch vs the roofline; constrained batch 32
#                                             # with the scheduler's mask-fill figures
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -s -p no:cacheprovider"
case "${1:-}" in
  small)
    timeout 120 $PYTEST tests/gpu/test_kernels_cuda.py tests/gpu/test_shared_prefix_cuda.py 2>&1 \
      | tail -4 | tee "$OUT/kernels.log"
    timeout 120 python3 benchmarks/kernels.py --small-decode 2>&1 | tee "$OUT/small.log"
    cd benchmarks
    timeout 120 python3 profile_step.py runner --batches 1 64 --rows 16 2>&1 \
      | tee "$OUT/profile.log" | grep -v "^\[transformers\]"
    timeout 120 python3 one_batch.py --backends triton+graph --batches 1 8 64 256 \
      --output-file "$OUT/one_batch.json" 2>&1 | tee "$OUT/one_batch.log" | grep -v "^\[transf"
    timeout "${CON_S:-120}" python3 offline.py --mode constrained --no-hf \
      --output-file "$OUT/constrained.json" 2>&1 | tee "$OUT/constrained.log" | grep "^|"
    ;;
  *) echo "usage: $0 small" >&2; exit 2 ;;
esac
