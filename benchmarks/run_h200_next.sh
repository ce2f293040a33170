#!/usr/bin/env bash
# What the tenth session built but could not measure on one H200, as device calls (each < 600 s),
# after the device-wheels install line (pin llguidance to the pyproject's version: the script's
# default wheel is older and the grammar backend then fails to start):
#   bash benchmarks/run_h200_next.sh checks   # GPU tests of the new code; constrained decoding at
#                                             # batch 32 (mask fill on the host, overhead)
#   bash benchmarks/run_h200_next.sh tune     # launch sweeps of the prefix-sharing decode (fp8)
#   bash benchmarks/run_h200_next.sh nogap    # the no-sharing gap: host vs device per decode step,
#                                             # radix cache on and off, 128 x 2176/256
#   bash benchmarks/run_h200_fp8.sh prefix    # then prefix sharing with the new kernels
# NOTE: never `git checkout HEAD -- ...` on the device: its copy carries the .git of the landed
# main, so that restores the session's starting code (tenth session, calls 4-5).
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -p no:cacheprovider"
case "${1:-}" in
  checks)
    timeout "${TEST_S:-300}" $PYTEST tests/gpu/test_grammar_cuda.py tests/gpu/test_kernels_cuda.py \
      tests/gpu/test_shared_prefix_cuda.py 2>&1 | tail -5 | tee "$OUT/tests.log"
    cd benchmarks
    timeout "${CON_S:-160}" python3 offline.py --mode constrained --no-hf \
      --output-file "$OUT/constrained.json" 2>&1 | tee "$OUT/constrained.log" | grep "^|\|mask"
    ;;
  tune)
    cd benchmarks
    timeout "${TUNE_S:-400}" python3 kernels.py --fp8-prefix 2>&1 | tee "$OUT/fp8_prefix.log"
    ;;
  nogap)
    cd benchmarks
    for cache in "" --no-radix-cache; do
      timeout "${GAP_S:-200}" python3 profile_step.py scheduler --kv-cache-dtype fp8_e4m3 \
        --num-prompts 128 --input-len 2176 --output-len 256 --max-running 1024 $cache 2>&1 \
        | tee -a "$OUT/nogap.log" | grep "DECODE\|medians\|steps in"
    done
    ;;
  *) echo "usage: $0 checks|tune|nogap" >&2; exit 2 ;;
esac
