#!/usr/bin/env bash
# Shared-prefix decode and the throughput runs on one H200, as two device calls (each < 600 s),
# after the device-wheels install line:
#   bash benchmarks/run_h200_shared.sh checks  # GPU tests (kernels, shared prefix, backends),
#                                              # the decode-kernel tuning sweep
#   bash benchmarks/run_h200_shared.sh suite   # shared-prefix kernel sweep; offline 1000 x
#                                              # 1000/1000 with the HF peer;
#                                              # prefix sharing: cache off / on / on, read per request
#   bash benchmarks/run_h200_shared.sh fp8     # the fp8 KV test; offline 1000 x 1000/1000 with an
#                                              # fp8 KV pool and up to 768 running
#   bash benchmarks/run_h200_shared.sh fp8prof # fp8 test; step profiles bf16 vs fp8; offline fp8 at 768
#   bash benchmarks/run_h200_shared.sh prefix1024  # batch-384 step profile; prefix sharing at 1024
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -s -p no:cacheprovider"
case "${1:-}" in
  checks)
    timeout 90 $PYTEST tests/gpu/test_kernels_cuda.py -k "decode_attention" 2>&1 \
      | tail -4 | tee "$OUT/kernels.log"
    timeout 150 python3 benchmarks/kernel_bench.py --decode-only 2>&1 | tee "$OUT/tune.log"
    timeout 120 $PYTEST tests/gpu/test_shared_prefix_cuda.py 2>&1 \
      | grep "shared_prefix_steps\|passed\|failed\|Error" | tee "$OUT/shared.log"
    timeout "${TEST_S:-220}" $PYTEST tests/gpu/test_engine_cuda.py -k backends_give 2>&1 \
      | grep "identical\|passed\|failed\|Error" | tee "$OUT/backends.log"
    ;;
  suite)
    timeout 90 python3 benchmarks/kernel_bench.py --shared-only 2>&1 | tee "$OUT/shared_tune.log"
    cd benchmarks
    big="--engine-arg max_running_requests=384 --engine-arg cuda_graph_max_bs=384"
    timeout "${OFF_S:-300}" python3 offline.py --mode offline --num-prompts 1000 \
      --hf-num-prompts 64 --hf-compile off $big --output-file "$OUT/offline.json" 2>&1 \
      | tee "$OUT/offline.log" | grep "^|\|copy band"
    timeout "${PRE_S:-220}" python3 offline.py --mode prefix --groups "${NGROUPS:-32}" \
      --group-size 16 $big --output-file "$OUT/prefix.json" 2>&1 \
      | tee "$OUT/prefix.log" | grep "^|\|copy band"
    ;;
  fp8)  # kv_cache_dtype fp8_e4m3: twice the tokens in the pool, half the KV bytes per step
    timeout 200 $PYTEST tests/gpu/test_engine_cuda.py tests/gpu/test_kernels_cuda.py -k "fp8" 2>&1 \
      | grep "pool\|passed\|failed\|Error" | tee "$OUT/fp8_test.log"
    cd benchmarks
    timeout "${OFF_S:-330}" python3 offline.py --mode offline --num-prompts 1000 --no-hf \
      --engine-arg kv_cache_dtype=fp8_e4m3 --engine-arg max_running_requests=768 \
      --engine-arg cuda_graph_max_bs=512 --output-file "$OUT/offline_fp8.json" 2>&1 \
      | tee "$OUT/offline_fp8.log" | grep "^|\|copy band"
    ;;
  fp8prof)  # where an fp8 step's time goes: model time per step bf16 vs fp8, host work at 768
    timeout 100 $PYTEST tests/gpu/test_engine_cuda.py -k "fp8" 2>&1 \
      | grep "pool\|passed\|failed\|Error" | tee "$OUT/fp8_test.log"
    cd benchmarks
    for kv in auto fp8_e4m3; do
      b="256 384"; [ $kv = fp8_e4m3 ] && b="256 384 768"
      timeout 120 python3 profile_step.py runner --kv-cache-dtype $kv --batches $b --context 1500 \
        --rows 8 2>&1 | tee "$OUT/runner_$kv.log" | grep "==\|decode_kernel\|Self CUDA"
    done
    timeout 150 python3 profile_step.py scheduler --kv-cache-dtype fp8_e4m3 --num-prompts 768 \
      --max-running 768 --input-len 1000 --output-len 64 2>&1 | tee "$OUT/sched_fp8.log" | tail -8
    timeout "${OFF_S:-200}" python3 offline.py --mode offline --num-prompts 1000 --no-hf \
      --engine-arg kv_cache_dtype=fp8_e4m3 --engine-arg max_running_requests=768 \
      --engine-arg cuda_graph_max_bs=768 --output-file "$OUT/offline_fp8.json" 2>&1 \
      | tee "$OUT/offline_fp8.log" | grep "^|.*offline\|copy band"
    ;;
  prefix1024)  # decode-step kernels at batch 384; prefix sharing with every group running at once
    cd benchmarks
    timeout 100 python3 profile_step.py runner --batches 384 --context 1504 --rows 12 \
      > "$OUT/runner384.log" 2>&1; grep "==" "$OUT/runner384.log"
    big="--engine-arg max_running_requests=1024 --engine-arg cuda_graph_max_bs=1024"
    timeout "${PRE_S:-420}" python3 offline.py --mode prefix --groups 64 --group-size 16 $big \
      --output-file "$OUT/prefix1024.json" > "$OUT/prefix1024.log" 2>&1
    grep "^|\|copy band" "$OUT/prefix1024.log"
    ;;
  variants)  # graph variants (plain / shared prefix): the GPU tests, then prefix sharing at 1024
    timeout 150 $PYTEST tests/gpu/test_shared_prefix_cuda.py tests/gpu/test_cuda_graph.py 2>&1 \
      | grep "shared_prefix_steps\|passed\|failed\|Error" | tee "$OUT/graph_tests.log"
    cd benchmarks
    big="--engine-arg max_running_requests=1024 --engine-arg cuda_graph_max_bs=1024"
    timeout "${PRE_S:-330}" python3 offline.py --mode prefix --groups 64 --group-size 16 $big \
      --output-file "$OUT/prefix1024.json" > "$OUT/prefix1024.log" 2>&1
    grep "^|\|copy band" "$OUT/prefix1024.log"
    ;;
  *) echo "usage: $0 checks|suite|fp8|fp8prof|prefix1024|variants" >&2; exit 2 ;;
esac
