#!/usr/bin/env bash
# What is left to measure on one H200, as device calls (each < 600 s), after the device-wheels
# install line. Carry two extras in .whl: llguidance 1.9.1 in place of the script's default
# (older: the grammar backend fails to start) and jsonschema with its dependencies (the GPU
# grammar test validates with it): `pip download llguidance==1.9.1 jsonschema
# jsonschema-specifications referencing attrs --no-deps` plus rpds-py for cp312 manylinux.
#   bash benchmarks/run_h200_next.sh checks   # the GPU grammar test (TEST_S=0: skipped);
#                                             # constrained decoding at batch 32 with the mask
#                                             # worker's threads (MODES: default, one, two)
#                                             # or step batches (batch): fill p50 / p99 and
#                                             # overhead
#   bash benchmarks/run_h200_next.sh extend   # the extend kernel's work list (the default on
#                                             # fp8 pools; WEFT_EXTEND_WORK=0 / 1 forces it):
#                                             # GPU tests (and the mask kernel's warm-up test),
#                                             # grid vs work list timed
#   bash benchmarks/run_h200_next.sh extprof  # kernels of the prefix-sharing run's extend steps
#                                             # (fp8, 64 groups x 16 on 2048 + 128) by GPU and
#                                             # host time; untraced with expandable segments;
#                                             # a GEMM's host time at new token counts
#   bash benchmarks/run_h200_next.sh tune     # launch sweeps of the prefix-sharing decode (fp8),
#                                             # the prefix kernel also timed alone
#   bash benchmarks/run_h200_next.sh nogap    # host vs device per decode step, radix cache on
#                                             # and off, 128 x 2176/256 (the gap it looked for
#                                             # closed in the twelfth session: on / off 1.000)
#   bash benchmarks/run_h200_next.sh gemv     # GPU tests of the batch-1 path: the decode kernel's
#                                             # rotation (k stored bit for bit as the rotary
#                                             # kernel's), the engine's bf16 greedy comparison,
#                                             # the graph cases (13 passed, twenty-second session)
#   bash benchmarks/run_h200_next.sh gemvstep # decode steps with the rotation in the decode kernel
#                                             # or its own launch (twice) under WEFT_PDL=on and
#                                             # =all (all: no gain, twenty-second session)
#   bash benchmarks/run_h200_next.sh trace    # the batch-1 and -8 decode steps kernel by kernel,
#                                             # programmatic dependents on and off: what each
#                                             # kernel adds to the step (marginal time), where the
#                                             # 1.19x goes (the next batch-1 attempt starts here)
#   bash benchmarks/run_h200_next.sh sums     # split sums by the last program (WEFT_SPLIT_SUM=here,
#                                             # the default) against their own launches: GPU tests,
#                                             # decode steps at batch 1, 8, 64 (here: -0.055 ms at
#                                             # 1 and 8, twenty-third session), small-batch decode
#                                             # launches merged here or by the reduce
#   bash benchmarks/run_h200_next.sh timeline # the decode step from the inside (per-program stamps:
#                                             # boundaries, work, tails, SMs) at batch 1 and 8,
#                                             # per step mode (MODES, e.g. "attn=plain attn=wait")
#   bash benchmarks/run_h200_next.sh fold     # the RMSNorms folded into the skinny GEMVs
#                                             # (WEFT_FOLD_NORM, off until timed): the folded
#                                             # kernel test, the bf16 greedy comparison (one
#                                             # variant folds), decode steps at batches 1-16
#                                             # with the norms folded and launched, twice
#   bash benchmarks/run_h200_fp8.sh prefix    # prefix sharing end to end
# NOTE: never `git checkout HEAD -- ...` on the device: its copy carries the .git of the landed
# main, so that restores the session's starting code (tenth session, calls 4-5).
# Run GPU tests with -v under a timeout: a run cut short then still shows which tests passed.
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -p no:cacheprovider"
case "${1:-}" in
  checks)
    [ "${TEST_S:-120}" = 0 ] || timeout "${TEST_S:-120}" $PYTEST tests/gpu/test_grammar_cuda.py \
      2>&1 | tail -5 | tee "$OUT/tests.log"
    cd benchmarks
    # the mask worker: its default threads (default), 1 (one), 2 (two), or step batches (batch)
    for mode in ${MODES:-default one}; do
      threads=$(case $mode in one|batch) echo 1;; two) echo 2;; *) echo "";; esac)
      WEFT_MASK_THREADS=$threads WEFT_MASK_BATCH=$([ $mode = batch ] && echo 1 || echo 0) timeout "${CON_S:-120}" python3 offline.py --mode constrained \
        --no-hf --output-file "$OUT/constrained_$mode.json" 2>&1 \
        | tee "$OUT/constrained_$mode.log" | grep "^| con\|^| JSON"
    done
    ;;
  extend)
    timeout "${TEST_S:-150}" python3 -m pytest -v -p no:cacheprovider tests/gpu/test_kernels_cuda.py \
      -k "extend or warmed" tests/gpu/test_grammar_cuda.py 2>&1 \
      | grep -E "PASS|FAIL|ERROR|passed|failed" | tee "$OUT/tests_extend.log"
    (cd benchmarks && timeout "${EXT_S:-150}" python3 kernel_bench.py --extend-work 2>&1 \
      | tee "$OUT/extend_work.log")
    ;;
  extprof)
    cd benchmarks
    timeout "${PROF_S:-200}" python3 profile_step.py scheduler --kv-cache-dtype fp8_e4m3 \
      --groups 64 --group-size 16 --prefix-len 2048 --input-len 128 --output-len 4 \
      --max-running 1024 --trace-steps "${STEPS:-6}" --trace-extend --rows 30 2>&1 \
      | tee "$OUT/extprof.log" | grep -v "^\s*$" | tail -60
    # the same run untraced under expandable segments (the caching allocator's other mode)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${PROF_S:-200}" python3 \
      profile_step.py scheduler --kv-cache-dtype fp8_e4m3 --groups 64 --group-size 16 \
      --prefix-len 2048 --input-len 128 --output-len 4 --max-running 1024 2>&1 \
      | tee "$OUT/extprof_expandable.log" | grep "EXTEND\|DECODE\|medians\|steps in"
    timeout 60 python3 gemm_host.py 2>&1 | tee "$OUT/gemm_host.log"
    ;;
  tune)
    cd benchmarks
    timeout "${TUNE_S:-400}" python3 kernel_bench.py --fp8-prefix 2>&1 | tee "$OUT/fp8_prefix.log"
    ;;
  nogap)
    cd benchmarks
    for cache in "" --no-radix-cache; do
      timeout "${GAP_S:-200}" python3 profile_step.py scheduler --kv-cache-dtype fp8_e4m3 \
        --num-prompts 128 --input-len 2176 --output-len 256 --max-running 1024 $cache 2>&1 \
        | tee -a "$OUT/nogap.log" | grep "DECODE\|medians\|steps in"
    done
    ;;
  gemv)
    K=tests/gpu/test_kernels_cuda.py
    timeout "${TEST_S:-420}" python3 -m pytest -v -rA -p no:cacheprovider \
      $K::test_decode_attention_with_rope_equals_rotary_then_decode \
      tests/gpu/test_engine_cuda.py::test_bf16_backends_give_the_torch_backends_greedy_tokens \
      tests/gpu/test_cuda_graph.py 2>&1 | tee "$OUT/tests_full.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|^\{" | tee "$OUT/tests.log"
    ;;
  gemvstep)
    cd benchmarks
    for pdl in on all; do
      WEFT_PDL=$pdl timeout "${STEP_S:-200}" python3 one_batch.py --backends triton+graph \
        --batches 1 8 16 --reps 20 --rope-modes separate fused separate fused 2>&1 \
        | grep -v Warning | tee -a "$OUT/rope_modes.log"
    done
    ;;
  trace)
    cd benchmarks
    for pdl in on off; do
      echo "== WEFT_PDL=$pdl" | tee -a "$OUT/trace.log"
      WEFT_PDL=$pdl timeout "${TRACE_S:-200}" python3 profile_step.py runner --batches 1 8 \
        --reps 5 --rows 20 2>&1 | grep -v Warning | tee -a "$OUT/trace.log" \
        | grep -A 45 "^== decode\|^per step"
    done
    ;;
  sums)
    timeout "${TEST_S:-120}" python3 -m pytest -v -p no:cacheprovider tests/gpu/test_kernels_cuda.py \
      -k "split_sums or decode_layer or test_decode_attention" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed" | tee "$OUT/tests_sums.log"
    cd benchmarks
    timeout "${STEP_S:-250}" python3 one_batch.py --backends triton+graph --batches 1 8 64 \
      --reps 20 --sum-modes here launch here launch 2>&1 | grep -v Warning \
      | tee "$OUT/sum_modes.log" | grep -E "^\{|copy" | grep -v prefill
    timeout "${SMALL_S:-200}" python3 decode_parts.py --small --batches 1 8 2>&1 \
      | grep -v Warning | tee "$OUT/small.log"
    ;;
  timeline)
    timeout "${TEST_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py \
      -k timeline 2>&1 | tail -2 | tee "$OUT/tests_timeline.log"
    cd benchmarks
    # shellcheck disable=SC2086
    timeout "${STEP_S:-300}" python3 step_timeline.py --batches ${BATCHES:-1 8} --layers 1 \
      --step-modes ${MODES:-attn=plain attn=wait} 2>&1 | grep -v -i warn | tee "$OUT/timeline.log"
    ;;
  fold)
    timeout "${TEST_S:-240}" python3 -m pytest -v -p no:cacheprovider tests/gpu/test_kernels_cuda.py \
      -k "folded or gemv or rmsnorm or torch_backends_greedy" tests/gpu/test_engine_cuda.py \
      -s 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|identical" | tee "$OUT/tests_fold.log"
    cd benchmarks
    timeout "${STEP_S:-300}" python3 one_batch.py --backends triton+graph --batches 1 4 8 16 \
      --reps 20 --step-modes norm=fold norm=launch norm=fold norm=launch 2>&1 | grep -v Warning \
      | tee "$OUT/fold_modes.log" | grep -E "^\{|copy" | grep -v prefill
    ;;
  *) echo "usage: $0 checks|extend|extprof|tune|nogap|gemv|gemvstep|trace|sums|timeline|fold" >&2; exit 2 ;;
esac
