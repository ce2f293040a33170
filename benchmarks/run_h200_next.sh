#!/usr/bin/env bash
# What the last session could not measure on one H200, as two device calls (each < 600 s), after
# the device-wheels install line:
#   bash benchmarks/run_h200_next.sh checks   # cross-backend greedy test (FlashInfer JIT
#                                             # included); constrained overhead, overlap on / off
#   bash benchmarks/run_h200_next.sh peer     # offline 256 x 1000/1000 with the HF peer, one run
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
case "${1:-}" in
  checks)
    timeout "${TEST_S:-280}" python3 -m pytest -q -x -s -p no:cacheprovider \
      tests/gpu/test_engine_cuda.py -k backends_give 2>&1 | grep -v "^\[transformers\]" \
      | grep "prompts_identical\|passed\|failed\|Error" | tee "$OUT/backends.log"
    cd benchmarks
    for o in auto off; do
      timeout "${CON_S:-140}" python3 offline.py --mode constrained --no-hf \
        --engine-arg overlap_schedule=$o --output-file "$OUT/constrained_$o.json" 2>&1 \
        | tee "$OUT/constrained_$o.log" | grep "^|"
    done
    ;;
  peer)
    cd benchmarks
    timeout "${OFF_S:-560}" python3 offline.py --mode offline --num-prompts 256 \
      --hf-num-prompts 64 --hf-compile off --output-file "$OUT/offline.json" 2>&1 \
      | tee "$OUT/offline.log" | grep "^|\|copy band"
    ;;
  *) echo "usage: $0 checks|peer" >&2; exit 2 ;;
esac
