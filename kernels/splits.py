"""How many splits the decode kernel walks a batch's contexts in: a model of its waves on the GPU."""

from __future__ import annotations

# One 64-key block per split is enough work once the reduce merges all splits in one pass
# (was 256 with a serial merge; see BENCHMARKS.md, sixth session).
MIN_SPLIT_TOKENS = 64
# The split count's model (decode_num_kv_splits), fitted to the default bf16 launch (64 keys,
# 4 warps) at kv 2048 in CUDA graphs on the H200, batch 1 to 128 (BENCHMARKS.md, fifteenth
# session): it picks the measured best count (or one within 2% of it) at every batch there;
# the old rule (~4 programs per SM) ran 4-21% slower at batches 8-96.
RESIDENT_PROGRAMS = 4
SATURATING_PROGRAMS = 2.4
SPLIT_COST = 0.96
# The same model for an fp8 pool's launch (128 keys, 4 warps, 3 stages: 140-146 registers and
# 73 KB of shared memory, so 3 programs per SM), fitted the same way at batch 1 to 512: it picks
# the measured best at every batch but 1 (32 splits, 13.1 us, against 16 at 12.3). The bf16
# model there picked counts up to 17% slower (batch 64: 124.6 vs 106.7 us; BENCHMARKS.md,
# eighteenth session).
FP8_RESIDENT_PROGRAMS = 3
FP8_SATURATING_PROGRAMS = 1.6
FP8_SPLIT_COST = 0.93


def decode_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132, fp8: bool = False
) -> int:
    """The power-of-2 split count (each split at least MIN_SPLIT_TOKENS of the longest context)
    that best fills the SMs, by a model of the kernel's waves fitted on the H200:

    - an SM holds RESIDENT_PROGRAMS programs at once, so the grid runs in rounds of that many
      per SM, the last one partial;
    - a round takes at least the time of SATURATING_PROGRAMS programs: fewer programs per SM
      do not draw the SM's share of the memory bandwidth;
    - each doubling of the splits costs SPLIT_COST (the partials and their reduce);
    - `fp8` (an fp8 pool, whose launch differs) takes the FP8_ constants instead.

    (A split's length follows each request's own length at run time, so a CUDA graph captured
    for the longest context still spreads a short one over all its splits.)"""
    cap = max(1, min(64, max_seq_len // MIN_SPLIT_TOKENS))
    programs = max(batch_size * num_kv_heads, 1)
    resident, saturating, split_cost = (
        (FP8_RESIDENT_PROGRAMS, FP8_SATURATING_PROGRAMS, FP8_SPLIT_COST)
        if fp8
        else (RESIDENT_PROGRAMS, SATURATING_PROGRAMS, SPLIT_COST)
    )
    best, best_score, splits, cost = 1, 0.0, 1, 1.0
    while splits <= cap:
        per_sm = programs * splits / num_sms
        full, last = divmod(per_sm, resident)
        rounds = full * resident + (max(last, saturating) if last > 0 else 0)
        score = per_sm / rounds * cost
        if score > best_score * (1 + 1e-6):  # ties go to fewer splits
            best, best_score = splits, score
        splits, cost = splits * 2, cost * split_cost
    return best
