"""Decode attention with a shared KV prefix (SharedPrefix, the cascade stage) on CPU under
TRITON_INTERPRET=1: against the float32 reference over each request's whole context, and against
the same kernel without sharing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_kernels  # the interpreter set-up; importing it skips this module without triton
import torch
from test_kernels import INTERPRETING, NAN, TOL, assert_close

POISON = 4  # slots [0, POISON) hold NaN: table entries no walk may read point there


interpreted = test_kernels.interpreted_in(__file__)


if INTERPRETING:  # test_kernels loaded kernels/ (and patched an old interpreter) on import
    wk: Any = test_kernels.wk
    ref: Any = test_kernels.ref


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(4321)


@pytest.fixture
def bf16_dot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The interpreter keeps bfloat16 as its uint16 bits and its tl.dot multiplies those bits
    (triton-lang/triton#11584: bf16 is unsupported there). For the test's duration, widen bf16 dot
    operands to float32 (exact) first; everything else of the kernels runs unpatched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h: Any) -> Any:
        if h.dtype != tl.bfloat16:
            return h
        bits = (h.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(bits, tl.float32)

    def create_dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        return original(self, widen(a), widen(b), *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    yield


@dataclass(frozen=True)
class Scenario:
    """Request b shares group group_of[b]'s prefixes[g] keys (-1: none), then has own[b] keys of
    its own (0 with no group: a padded row, seq_len 0). blocks: (group, members) per SharedPrefix
    block, members padded with -1 to the longest; group -1 is an unused block (length 0) whose
    members, if any, are stale."""

    prefixes: list[int]
    group_of: list[int]
    own: list[int]
    blocks: list[tuple[int, list[int]]]


# two groups (3 and 2 members) and two loners; an unused block with stale members
TWO_GROUPS = Scenario(
    prefixes=[37, 80],
    group_of=[0, 1, -1, 0, 1, 0, -1],
    own=[1, 5, 9, 20, 1, 3, 30],
    blocks=[(0, [0, 3, 5, -1]), (1, [1, 4]), (-1, [2, 6])],
)
# one group of 5 over two blocks (the second partly filled), a loner, a padded row
SPLIT_GROUP = Scenario(
    prefixes=[50],
    group_of=[0, 0, -1, 0, 0, -1, 0],
    own=[1, 17, 6, 3, 40, 0, 1],
    blocks=[(0, [0, 1, 3]), (0, [4, 6, -1]), (-1, [-1, -1, -1])],
)
# 10 members in one block: in fp32 with G = 4, two member tiles of 8 (32 query rows each)
WIDE_BLOCK = Scenario(
    prefixes=[64],
    group_of=[0] * 10 + [-1],
    own=[1, 2, 3, 4, 5, 6, 7, 8, 9, 33, 0],
    blocks=[(0, list(range(10)))],
)
# nobody shares: kv_starts all 0, only unused blocks
NO_SHARING = Scenario(
    prefixes=[20], group_of=[-1, -1, -1], own=[7, 1, 40], blocks=[(-1, [0, 1]), (-1, [2, -1])]
)


@dataclass
class Batch:
    q: torch.Tensor  # [B, H, D]
    k_buffer: torch.Tensor  # [num_slots, Hkv, D]; slots no walk may read hold NaN
    v_buffer: torch.Tensor
    table: torch.Tensor  # [rows, ctx]: each request's row holds its whole context
    cascade_table: torch.Tensor  # the same, but members' prefix entries point at NaN slots
    rows: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]; 0 = a padded row
    kv_starts: torch.Tensor  # [B]
    shared: Any  # SharedPrefix


def make_batch(
    sc: Scenario,
    heads: int,
    hkv: int,
    dim: int,
    dtype: torch.dtype,
    num_splits: int,
    index: torch.dtype = torch.int64,
    **launch: int | None,  # SharedPrefix's block_n, num_warps, num_stages
) -> Batch:
    """The scenario on a shuffled pool. Each group's prefix sits in a spare table row, its blocks'
    row; the cascade table points members' prefix entries at NaN slots, so that only the block row
    can supply the prefix, and the full table gives the reference every request's whole context."""
    bsz = len(sc.own)
    pre_lens = [sc.prefixes[g] if g >= 0 else 0 for g in sc.group_of]
    lens = [p + n for p, n in zip(pre_lens, sc.own, strict=True)]
    used = sum(sc.prefixes) + sum(sc.own)
    num_slots = POISON + used + 3
    k_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dtype)
    v_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dtype)
    free = (torch.randperm(num_slots - POISON) + POISON).tolist()
    k_buffer[free[:used]] = torch.randn(used, hkv, dim).to(dtype)
    v_buffer[free[:used]] = torch.randn(used, hkv, dim).to(dtype)

    def take(n: int) -> torch.Tensor:
        nonlocal free
        slots, free = torch.tensor(free[:n], dtype=torch.int64), free[n:]
        return slots

    num_rows = bsz + len(sc.prefixes) + 3
    table = torch.randint(POISON, (num_rows, max(lens) + 5))
    order = torch.randperm(num_rows).tolist()
    rows, spare = order[:bsz], order[bsz : bsz + len(sc.prefixes)]
    prefix_slots = [take(n) for n in sc.prefixes]
    for g, slots in enumerate(prefix_slots):
        table[spare[g], : len(slots)] = slots
    cascade_table = table.clone()
    for b, (g, n) in enumerate(zip(sc.group_of, sc.own, strict=True)):
        mine = take(n)
        pre = prefix_slots[g] if g >= 0 else mine[:0]
        table[rows[b], : len(pre) + n] = torch.cat((pre, mine))
        cascade_table[rows[b], len(pre) : len(pre) + n] = mine

    width = max(len(m) for _, m in sc.blocks)
    members = [m + [-1] * (width - len(m)) for _, m in sc.blocks]
    shared = wk.SharedPrefix(
        torch.tensor(members, dtype=index),
        torch.tensor([spare[g] if g >= 0 else 0 for g, _ in sc.blocks], dtype=index),
        torch.tensor([sc.prefixes[g] if g >= 0 else 0 for g, _ in sc.blocks], dtype=index),
        num_splits,
        **launch,
    )
    return Batch(
        q=torch.randn(bsz, heads, dim).to(dtype),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        table=table.to(index),
        cascade_table=cascade_table.to(index),
        rows=torch.tensor(rows, dtype=index),
        seq_lens=torch.tensor(lens, dtype=index),
        kv_starts=torch.tensor(pre_lens, dtype=index),
        shared=shared,
    )


def check(batch: Batch, splits: int, dtype: torch.dtype, **kwargs: Any) -> None:
    """The cascade call (output NaN-poisoned first) against the reference over the full table
    and against the kernel without sharing; padded rows give zeros."""
    out = torch.full(batch.q.shape, NAN, dtype=dtype)
    pool = (batch.k_buffer, batch.v_buffer)
    scale = batch.q.shape[2] ** -0.5
    cascade = (batch.cascade_table, batch.rows, batch.seq_lens)
    plan = wk.DecodePlan(splits, kv_starts=batch.kv_starts, shared=batch.shared, **kwargs)
    wk.decode_attention(batch.q, *pool, *cascade, out, scale, plan)
    live = (batch.seq_lens > 0).nonzero().flatten()
    padded = (batch.seq_lens == 0).nonzero().flatten()
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    full = (batch.table, batch.rows[live], batch.seq_lens[live])
    assert_close(
        out[live], ref.decode_attention_ref(batch.q[live], *pool, *full, scale), TOL[dtype]
    )
    plain = torch.full(batch.q.shape, NAN, dtype=dtype)
    args = (batch.table, batch.rows, batch.seq_lens, plain, scale)
    wk.decode_attention(batch.q, *pool, *args, wk.DecodePlan(splits, block_n=kwargs.get("block_n")))
    assert_close(out[live], plain[live].float(), TOL[dtype])


CASES = [
    # scenario, heads, kv heads, dtype, splits, prefix splits, block_n (both kernels)
    pytest.param(TWO_GROUPS, 8, 2, torch.bfloat16, 1, 1, None, id="two-groups-G4-bf16-defaults"),
    pytest.param(TWO_GROUPS, 2, 2, torch.bfloat16, 3, 2, 16, id="two-groups-G1-bf16-s3-p2"),
    pytest.param(TWO_GROUPS, 8, 2, torch.float32, 2, 3, 16, id="two-groups-G4-fp32-s2-p3"),
    pytest.param(SPLIT_GROUP, 8, 2, torch.float32, 1, 5, 16, id="split-group-G4-fp32-p5-one-empty"),
    pytest.param(SPLIT_GROUP, 2, 1, torch.bfloat16, 4, 1, 16, id="split-group-G2-bf16-s4"),
    pytest.param(SPLIT_GROUP, 6, 2, torch.float16, 2, 2, 16, id="split-group-G3-fp16"),
    pytest.param(WIDE_BLOCK, 8, 2, torch.float32, 2, 2, None, id="wide-block-G4-fp32-two-tiles"),
    pytest.param(WIDE_BLOCK, 2, 2, torch.bfloat16, 1, 1, None, id="wide-block-G1-bf16"),
]


@pytest.mark.parametrize("sc, heads, hkv, dtype, splits, prefix_splits, block_n", CASES)
@interpreted
def test_shared_prefix_matches_reference(
    sc: Scenario,
    heads: int,
    hkv: int,
    dtype: torch.dtype,
    splits: int,
    prefix_splits: int,
    block_n: int | None,
    request: pytest.FixtureRequest,
) -> None:
    if dtype == torch.bfloat16:
        request.getfixturevalue("bf16_dot")
    batch = make_batch(sc, heads, hkv, 32, dtype, prefix_splits, block_n=block_n)
    check(batch, splits, dtype, block_n=block_n)


@interpreted
def test_graph_style_workspace_int32_and_launch_overrides() -> None:
    """A larger NaN-poisoned workspace (more rows and columns than needed), int32 indices
    everywhere, and num_warps / num_stages overrides for both stage-1 kernels."""
    launch = {"block_n": 16, "num_warps": 2, "num_stages": 1}
    batch = make_batch(SPLIT_GROUP, 8, 2, 32, torch.float32, 2, torch.int32, **launch)
    bsz = batch.q.shape[0]
    partials = (torch.full((bsz + 3, 8, 7, 32), NAN), torch.full((bsz + 3, 8, 7), NAN))
    check(batch, 3, torch.float32, partials=partials, **launch)


@pytest.mark.parametrize("splits", [1, 3])
@interpreted
def test_own_and_prefix_tiles_of_different_sizes(splits: int) -> None:
    """The own kernel's tiles smaller than the prefix kernel's (as an fp8 pool's defaults have
    them: 32 and 128 keys): the split ranges and the merge of both kernels' columns still agree,
    with one split (merged in the split kernel) and with three (merged in the reduce)."""
    batch = make_batch(TWO_GROUPS, 8, 2, 32, torch.float32, 2, block_n=32)
    check(batch, splits, torch.float32, block_n=16)


@interpreted
def test_no_member_shares_gives_plain_decode() -> None:
    check(make_batch(NO_SHARING, 4, 2, 32, torch.float32, 3), 2, torch.float32)


@interpreted
def test_invalid_arguments() -> None:
    batch = make_batch(TWO_GROUPS, 4, 2, 32, torch.float32, 2)
    out = torch.empty(batch.q.shape)
    args = (batch.q, batch.k_buffer, batch.v_buffer, batch.table, batch.rows, batch.seq_lens, out)
    with pytest.raises(ValueError, match="together"):
        wk.DecodePlan(2, kv_starts=batch.kv_starts)
    with pytest.raises(ValueError, match="together"):
        wk.DecodePlan(2, shared=batch.shared)
    with pytest.raises(ValueError, match="num_kv_splits"):
        wk.DecodePlan(0)
    shared = batch.shared
    members, rows, lens = shared.block_members, shared.block_rows, shared.block_lens
    with pytest.raises(ValueError, match="block_members"):
        wk.SharedPrefix(members[:, :0], rows, lens, 1)
    with pytest.raises(ValueError, match="block_members"):
        wk.SharedPrefix(members.flatten(), rows, lens, 1)
    with pytest.raises(ValueError, match="block_lens"):
        wk.SharedPrefix(members, rows, lens[:1], 1)
    with pytest.raises(ValueError, match="num_splits"):
        wk.SharedPrefix(members, rows, lens, 0)
    with pytest.raises(ValueError, match="block_n"):
        wk.SharedPrefix(members, rows, lens, 1, block_n=8)
    narrow = (torch.empty(7, 4, 3, 32), torch.empty(7, 4, 3))  # 2 + 2 columns needed
    with pytest.raises(AssertionError):
        plan = wk.DecodePlan(2, partials=narrow, kv_starts=batch.kv_starts, shared=shared)
        wk.decode_attention(*args, 0.1, plan)


@interpreted
def test_triton_backend_reads_planned_prefixes_eagerly_and_from_graph_buffers() -> None:
    """The runtime wiring: TritonAttentionBackend given a SharedPrefixPlan, eagerly and through
    the static buffers a CUDA graph reads (prepare_graph, then prepare_replay per step, here
    without a graph), equals the torch backend; a step without a plan, prepared as the plain
    graph variant, too."""
    from weft.runtime.executor.attention.torch_backend import TorchAttentionBackend
    from weft.runtime.executor.attention.triton_backend import TritonAttentionBackend
    from weft.runtime.executor.batch import ForwardBatch, ForwardMode
    from weft.runtime.executor.memory import KVPool
    from weft.runtime.executor.shared_prefix import MEMBERS_PER_BLOCK, SharedPrefixPlan

    heads, hkv, dim, prefix, pad = 4, 2, 16, 40, 8
    pool = KVPool(600, 1, hkv, dim, torch.float32, "cpu")
    pool.k[0].normal_()
    pool.v[0].normal_()
    table = torch.zeros(10, 128, dtype=torch.int64)  # row 0: the padding row
    own, rows = [5, 9, 1, 30, 12], [3, 1, 7, 2, 5]  # requests 0-2 share the prefix
    shared_slots, nxt, seq = torch.arange(10, 10 + prefix), 100, []
    for b, n in enumerate(own):
        start = shared_slots if b < 3 else torch.arange(nxt, nxt + prefix)
        nxt += 0 if b < 3 else prefix
        table[rows[b], : prefix + n] = torch.cat([start, torch.arange(nxt, nxt + n)])
        nxt += n
        seq.append(prefix + n)
    plan = SharedPrefixPlan(
        kv_starts=[prefix] * 3 + [0, 0],
        block_members=[[0, 1, 2] + [-1] * (MEMBERS_PER_BLOCK - 3)],
        block_rows=[rows[0]],
        block_lens=[prefix],
    )
    bsz = len(own)
    q, k, v = torch.randn(bsz, heads, dim), torch.randn(bsz, hkv, dim), torch.randn(bsz, hkv, dim)
    rows_t, seq_t = torch.tensor(rows), torch.tensor(seq)

    def batch(n: int, shared: SharedPrefixPlan | None) -> ForwardBatch:
        padded = [0] * (n - bsz)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.zeros(n, dtype=torch.int64),
            positions=torch.tensor([s - 1 for s in seq] + padded),
            out_cache_loc=torch.cat([table[rows_t, seq_t - 1], torch.zeros(n - bsz).long()]),
            req_rows=torch.tensor(rows + padded),
            seq_lens=torch.tensor(seq + padded),
            extend_lens=torch.ones(n, dtype=torch.int64),
            seq_lens_cpu=seq + padded,
            extend_lens_cpu=[1] * n,
            shared=shared,
        )

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.zeros(pad - bsz, *x.shape[1:])])

    reference = TorchAttentionBackend(pool, table)
    reference.prepare(batch(bsz, None))
    want = reference.forward(q, k, v, 0, batch(bsz, None), dim**-0.5)
    backend = TritonAttentionBackend(pool, table)
    backend.shared_prefix = True
    backend.prepare(batch(bsz, plan))
    assert backend.shared is not None and backend.kv_starts is not None
    assert_close(backend.forward(q, k, v, 0, batch(bsz, plan), dim**-0.5), want, TOL[torch.float32])
    assert backend.graph_variants() == (False, True)
    static = batch(pad, None)  # what a graph of size `pad` would have captured
    for step_plan in (plan, None, plan):  # a step without groups replays the plain graph
        shared = step_plan is not None
        backend.prepare_graph(static, shared)
        backend.prepare_replay(batch(bsz, step_plan), pad, shared)
        if shared:
            assert backend.kv_starts is not None and backend.shared is not None
            assert backend.kv_starts[:bsz].tolist() == plan.kv_starts
        else:
            assert backend.kv_starts is None and backend.shared is None
        out = backend.forward(padded(q), padded(k), padded(v), 0, static, dim**-0.5)
        assert_close(out[:bsz], want, TOL[torch.float32])
        assert not out[bsz:].any(), "padded rows attend nothing"
    backend.shared_prefix = False
    assert backend.graph_variants() == (False,)


@interpreted
def test_scheduler_on_the_triton_backend_reads_shared_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path on CPU, kernels interpreted: scheduler -> radix tree -> plan -> triton
    backend. Requests sharing a 260-token prompt prefix get the torch backend's greedy tokens
    with the prefix read once per group and with it read per request; decode steps used plans."""
    import transformers
    from support import save_word_tokenizer

    import weft.runtime.executor.attention as attention
    from weft.runtime.config import EngineConfig
    from weft.runtime.executor.distributed import Inbox
    from weft.runtime.ipc.messages import TokenizedGenerateReq
    from weft.runtime.sampling_params import SamplingParams
    from weft.runtime.scheduler.scheduler import Scheduler

    monkeypatch.setattr(attention, "_CUDA_ONLY", {"flashinfer"})  # triton runs interpreted here
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path, 512)
    shared = [(7 * i) % 500 + 3 for i in range(260)]
    prompts = [shared + [10 + i, 20 + i, 30 + i] for i in range(3)] + [[5, 6, 7, 8]]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)

    def run(**kwargs: Any) -> tuple[list[list[int]], int]:
        cfg = EngineConfig(model=str(tmp_path), cpu_threads=1, **kwargs)
        sched = Scheduler(cfg, tmp_path, None)
        done: dict[str, list[int]] = {}
        sched.emit = lambda reqs: done.update(  # type: ignore[method-assign]
            {r.rid: list(r.output_ids) for r in reqs if r.finished}
        )
        for i, ids in enumerate(prompts):
            sched.add_request(TokenizedGenerateReq(f"r{i}", ids, params, 5))
        while sched.has_work():
            sched.apply(Inbox([], [], []))
            sched.process_results(sched.launch(sched.schedule()))
        sched.cache.check_conservation()
        return [done[f"r{i}"] for i in range(len(prompts))], sched.runner.num_shared_prefix_steps

    reference, _ = run(attention_backend="torch")
    per_request, none = run(attention_backend="triton", disable_shared_prefix_decode=True)
    once, planned = run(attention_backend="triton")
    assert none == 0 and planned >= 4, planned
    assert per_request == reference
    assert once == reference
