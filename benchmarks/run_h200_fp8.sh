#!/usr/bin/env bash
# The fp8 (e4m3) KV decode on one H200 (one device call, < 600 s), after the device-wheels
# install line:
#   bash benchmarks/run_h200_fp8.sh kernel    # fp8 kernel GPU tests; weft's fp8 decode (V staged
#                                             # and sunk) next to FlashInfer's; offline
#                                             # 1000 x 1000/1000 with fp8 KV, 512 running
#   bash benchmarks/run_h200_fp8.sh offline   # the offline run alone, bf16 and fp8 KV
#   bash benchmarks/run_h200_fp8.sh prefix    # prefix sharing, 64 groups x 16, 1024 running, fp8
#                                             # KV (KV=auto for bf16), SM clocks logged: the
#                                             # no-sharing on / off ratio with pages lowest first
# Logs under $OUT (or ./h200-logs).
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
PYTEST="python3 -m pytest -q -s -p no:cacheprovider"
offline() {  # $1: tag, then engine args
  local tag=$1; shift
  (cd benchmarks && timeout "${OFF_S:-240}" python3 offline.py --mode offline \
    --num-prompts "${NUM:-1000}" --no-hf "$@" --output-file "$OUT/offline_$tag.json" 2>&1 \
    | tee "$OUT/offline_$tag.log" | grep "^|\|copy band\|Error")
}
fp8="--engine-arg kv_cache_dtype=fp8_e4m3 --engine-arg max_running_requests=512"
fp8="$fp8 --engine-arg cuda_graph_max_bs=512"
case "${1:-}" in
  kernel)
    timeout 150 $PYTEST tests/gpu/test_kernels_cuda.py -k "fp8 or decode" 2>&1 | tail -4 \
      | tee "$OUT/kernels.log"
    timeout 200 python3 benchmarks/kernel_bench.py --fp8-peer 2>&1 | tee "$OUT/peer.log"
    offline fp8 $fp8
    ;;
  offline)
    offline fp8 $fp8
    offline bf16 --engine-arg max_running_requests=384 --engine-arg cuda_graph_max_bs=384
    ;;
  prefix)
    (while sleep 10; do nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active \
      --format=csv,noheader; done) > "$OUT/smi.log" 2>&1 &
    (cd benchmarks && timeout "${PRE_S:-420}" python3 offline.py --mode prefix --groups 64 \
      --group-size 16 --engine-arg "kv_cache_dtype=${KV:-fp8_e4m3}" \
      --engine-arg max_running_requests=1024 --engine-arg cuda_graph_max_bs=1024 \
      --output-file "$OUT/prefix.json" 2>&1 | tee "$OUT/prefix.log" | grep "^|\|copy band")
    kill %1
    ;;
  *) echo "usage: $0 kernel|offline|prefix" >&2; exit 2 ;;
esac
