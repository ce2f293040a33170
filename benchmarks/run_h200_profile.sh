#!/usr/bin/env bash
# On the lent H200 (after the device-wheels install line): GPU tests, then where a step's time goes.
# Logs go to $OUT (or ./h200-logs). Each part has its own time limit so one slow part keeps the rest.
set -u
OUT=${OUT:-h200-logs}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${TEST_S:-240}" python3 -m pytest -q -x tests/gpu -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/tests_gpu.log"
cd benchmarks
timeout "${RUNNER_S:-120}" python3 profile_step.py runner --rows 18 2>&1 | tee "$OUT/profile_runner.log" | grep -v "^\s*$" | head -120
timeout "${SCHED_S:-120}" python3 profile_step.py scheduler --num-prompts 256 --output-len 200 2>&1 | tee "$OUT/profile_sched.log" | tail -8
timeout "${CPROF_S:-100}" python3 profile_step.py scheduler --num-prompts 256 --output-len 100 --cprofile --rows 30 2>&1 | tee "$OUT/profile_sched_cprof.log" | tail -45
