"""weft.kernels on CPU under TRITON_INTERPRET=1, small shapes, against the float32 references."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from support import kernel_names

triton = pytest.importorskip(
    "triton",
    reason="triton is not importable: the Triton kernels cannot be tested (pip install triton)",
)

ROOT = Path(__file__).resolve().parents[2]
NAN = float("nan")


def _interpreting() -> bool:
    """Whether this process's triton was imported with TRITON_INTERPRET=1.

    Triton picks interpreter or compiler when @triton.jit runs, and triton.language's own helpers
    (tl.sum, tl.cdiv, ...) are decorated at triton's first import. Setting the variable later, in a
    test module, is too late whenever anything imported triton first (tests/gpu, the runtime), and
    setting it for a whole session would turn the CUDA tests' kernels into interpreted ones. So a
    process that interprets runs the checks itself (`TRITON_INTERPRET=1 pytest <this file>`), and any
    other runs this file once in a child process that does, and reports each test's outcome.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton.language.standard.cdiv, InterpretedFunction)


def _patch_old_interpreter() -> None:
    """triton < 3.7's interpreter turns a loaded scalar (a 1-element array) into a loop bound with
    int(), which numpy >= 2.4 refuses; 3.7 squeezes first. Do the same here."""
    from triton.runtime import interpreter

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _load_kernels() -> Any:
    """kernels/ imported by path as its own package: no `import weft` (and its runtime) needed."""
    name = "_weft_kernels_interpreted"
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(ROOT / "kernels")]
    sys.modules[name] = importlib.util.module_from_spec(spec)
    return kernel_names(name)


def _child_results(path: str) -> dict[str, tuple[str, str]]:
    """Run the test file `path` under TRITON_INTERPRET=1 in a child pytest: test name ->
    (outcome, detail)."""
    drop = ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS")  # the child runs every test of the file
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"]
        proc = subprocess.run(
            [*cmd, f"--junit-xml={report}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if not report.exists():
            raise RuntimeError(
                f"child pytest wrote no report (exit {proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        results = {}
        for case in ET.parse(report).iter("testcase"):
            outcome, detail = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome, detail = kind, (node.text or node.get("message") or "").strip()
            results[case.get("name", "")] = (outcome, detail)
        return results


def interpreted_in(path: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A decorator for the tests of file `path`: run the test here if this process interprets
    Triton, else report its outcome from one child run of the whole file (see _interpreting)."""
    results = functools.cache(functools.partial(_child_results, path))

    def interpreted(test: Callable[..., None]) -> Callable[..., None]:
        if INTERPRETING:
            return test

        @functools.wraps(test)
        def from_child(*args: object, **kwargs: object) -> None:
            assert os.environ.get("TRITON_INTERPRET") != "1", (
                "triton was imported before TRITON_INTERPRET"
            )
            name = os.environ["PYTEST_CURRENT_TEST"].split("::", 1)[1].rsplit(" ", 1)[0]
            outcome, detail = results().get(name, ("missing", "not reported by the child"))
            if outcome == "skipped":
                pytest.skip(detail)
            if outcome != "passed":
                pytest.fail(
                    f"{outcome} under TRITON_INTERPRET=1 (child process):\n{detail}", pytrace=False
                )

        return from_child

    return interpreted


INTERPRETING = _interpreting()
interpreted = interpreted_in(__file__)
if INTERPRETING:
    _patch_old_interpreter()
    wk: Any = _load_kernels()
    ref: Any = wk.reference


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def assert_close(out: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Every element written and finite; relative L2 error under tol."""
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs unwritten (NaN)"
    err = ((out.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Pool:
    k_buffer: torch.Tensor  # [num_slots, Hkv, D]; slots no request owns hold NaN
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_context]; entries past a request point at NaN
    req_rows: torch.Tensor  # [B]


def make_pool(
    lens: list[int], filled: list[int], page_size: int, hkv: int, dim: int, dtype: torch.dtype
) -> Pool:
    """Requests of lens[b] tokens on shuffled pages (page 0 reserved) at shuffled table rows; only
    their first filled[b] slots get K/V. Everything else is NaN, so a stray read shows."""
    pages_per = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages_per) + 2
    shape = (num_pages * page_size, hkv, dim)
    k_buffer = torch.full(shape, NAN, dtype=dtype)
    v_buffer = torch.full(shape, NAN, dtype=dtype)
    max_context = max(lens) + 8
    poison = torch.arange(page_size)  # slots of page 0
    rows = torch.randperm(len(lens) + 3)[: len(lens)]
    table = poison[torch.randint(page_size, (len(lens) + 3, max_context))]
    pages = (torch.randperm(num_pages - 1) + 1).tolist()
    for b, (n, f) in enumerate(zip(lens, filled, strict=True)):
        mine = torch.tensor(pages[: pages_per[b]], dtype=torch.int64)
        pages = pages[pages_per[b] :]
        slots = (mine[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
        table[rows[b], :n] = slots
        k_buffer[slots[:f]] = torch.randn(f, hkv, dim).to(dtype)
        v_buffer[slots[:f]] = torch.randn(f, hkv, dim).to(dtype)
    return Pool(k_buffer, v_buffer, table, rows)


DECODE_CASES = [
    # heads, kv heads, head dim, page size, splits, dtype, seq lens, block_n
    (4, 4, 64, 1, 1, torch.float32, [1, 17, 40], 16),
    (8, 2, 128, 16, 4, torch.float16, [5, 33, 70], 16),
    (8, 1, 64, 16, 3, torch.float32, [64, 1, 100, 49], 16),
    (8, 2, 64, 1, 8, torch.float16, [9, 50], 16),
    (4, 4, 128, 16, 2, torch.float32, [130, 3], None),  # default block size
    (8, 2, 64, 16, 32, torch.float16, [300, 5, 64], 16),  # a wide reduce, most splits unused
    (12, 2, 64, 16, 2, torch.float32, [40, 7], 16),  # the reduce's last head block is partial
    (12, 4, 64, 1, 1, torch.float16, [33, 2], 16),  # one split: written without a reduce
]


@pytest.mark.parametrize("heads, hkv, dim, page, splits, dtype, lens, block_n", DECODE_CASES)
@interpreted
def test_decode_attention(
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    splits: int,
    dtype: torch.dtype,
    lens: list[int],
    block_n: int | None,
) -> None:
    pool = make_pool(lens, lens, page, hkv, dim, dtype)
    bsz = len(lens)
    q = torch.randn(bsz, heads, dim).to(dtype)
    seq_lens = torch.tensor(lens)
    out = torch.full((bsz, heads, dim), NAN, dtype=dtype)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, seq_lens)
    wk.decode_attention(q, *args, out, dim**-0.5, wk.DecodePlan(splits, block_n=block_n))
    assert_close(out, ref.decode_attention_ref(q, *args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("case", [c for c in DECODE_CASES if c[4] > 1])
@interpreted
def test_decode_splits_merged_by_the_last_to_arrive_equal_the_reduce_launch(
    case: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last split program of each (request, kv head) merges the group's partial results,
    and no reduce kernel is launched: the same output as the reduce launch (forced here with a
    merge limit of 0), and the arrival counters are zeros again after."""

    heads, hkv, dim, page, splits, dtype, lens, block_n = case
    pool = make_pool(lens + [0], lens + [0], page, hkv, dim, dtype)  # + a padded row
    bsz = len(lens) + 1
    q = torch.randn(bsz, heads, dim).to(dtype)
    args = (
        pool.k_buffer,
        pool.v_buffer,
        pool.req_to_token,
        pool.req_rows,
        torch.tensor(lens + [0]),
    )
    reduce_kernel = wk.decode._decode_reduce_kernel
    outs = []
    for merged_here in (True, False):
        if merged_here:
            monkeypatch.setattr(wk.decode, "_decode_reduce_kernel", None)
        else:
            monkeypatch.setattr(wk.decode, "_decode_reduce_kernel", reduce_kernel)
            monkeypatch.setattr(wk.decode, "MERGE_MAX_SPLITS", 0)
        out = torch.full((bsz, heads, dim), NAN, dtype=dtype)
        plan = wk.DecodePlan(splits, block_n=block_n)
        outs.append(wk.decode_attention(q, *args, out, dim**-0.5, plan))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][-1], torch.zeros(heads, dim, dtype=dtype))
    counters = wk.arrivals.arrival_counters(torch.device("cpu"), "decode", 1)
    assert counters is not None and not counters.any()


@interpreted
def test_more_splits_than_the_merge_holds_take_the_reduce_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split kernel merges at most MERGE_MAX_SPLITS splits itself (more would spill);
    beyond that the reduce kernel is launched, and the output is still right."""
    pool = make_pool([40, 7], [40, 7], 16, 1, 32, torch.float16)
    q = torch.randn(2, 4, 32).to(torch.float16)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor([40, 7]))
    launches = []

    class Counted:
        def __getitem__(self, grid: tuple) -> object:
            launches.append(grid)
            return reduce_kernel[grid]

    reduce_kernel = wk.decode._decode_reduce_kernel
    splits = wk.decode.MERGE_MAX_SPLITS
    monkeypatch.setattr(wk.decode, "_decode_reduce_kernel", Counted())
    for n in (splits, 2 * splits):
        out = torch.full_like(q, NAN)
        wk.decode_attention(q, *args, out, 0.125, wk.DecodePlan(n, block_n=16))
        assert_close(out, ref.decode_attention_ref(q, *args, 0.125), TOL[torch.float16])
    assert launches == [(2, 4)]  # the reduce ran for 2 * MERGE_MAX_SPLITS splits only


@pytest.mark.parametrize("splits", [1, 4])
@interpreted
def test_decode_attention_workspace_padded_rows_int32(splits: int) -> None:
    """A larger poisoned workspace is accepted; a row of seq_len 0 (graph padding) gives zeros;
    int32 index tensors work as int64 ones do. (One split: the kernel writes `out` itself.)"""
    lens = [0, 21, 0, 6]
    pool = make_pool([max(n, 1) for n in lens], lens, 16, 2, 64, torch.float32)
    q = torch.randn(4, 8, 64)
    table, rows, seq_lens = pool.req_to_token.int(), pool.req_rows.int(), torch.tensor(lens).int()
    partials = (torch.full((6, 8, 5, 64), NAN), torch.full((6, 8, 5), NAN))
    out = torch.full((4, 8, 64), NAN)
    args = (pool.k_buffer, pool.v_buffer, table, rows, seq_lens)
    wk.decode_attention(q, *args, out, 0.1, wk.DecodePlan(splits, partials=partials, block_n=16))
    assert torch.equal(out[[0, 2]], torch.zeros(2, 8, 64))
    live = torch.tensor([1, 3])
    pool_args = (pool.k_buffer, pool.v_buffer, table, rows[live], seq_lens[live])
    assert_close(out[live], ref.decode_attention_ref(q[live], *pool_args, 0.1), 1e-5)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@interpreted
def test_decode_attention_rotates_and_stores_the_new_token(splits: int, dtype: torch.dtype) -> None:
    """rope: the decode launch rotates q and the new k and stores k and v itself, as the rotary
    kernel (kv_store) and a plain decode launch after it do. The new tokens' slots start NaN, so
    a missing store shows; a padded row (seq_len 0) stores nothing."""
    lens, dim = [37, 0, 130, 64], 64
    pool = make_pool([max(n, 1) for n in lens], [max(n - 1, 0) for n in lens], 16, 2, dim, dtype)
    seq_lens = torch.tensor(lens)
    positions = (seq_lens - 1).clamp(min=0)
    loc = pool.req_to_token[pool.req_rows, positions]  # the padded row's: a NaN slot of page 0
    cache = wk.cos_sin_cache(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), 256)
    q, k, v = (torch.randn(4, h, dim).to(dtype) for h in (8, 2, 2))
    live = torch.tensor([0, 2, 3])
    k_pool, v_pool = pool.k_buffer.clone(), pool.v_buffer.clone()
    q_rot, k_rot = q.clone(), k.clone()
    wk.rotary_embedding(positions, q_rot, k_rot, cache)
    k_pool[loc[live]], v_pool[loc[live]] = k_rot[live], v[live]
    table = (pool.req_to_token, pool.req_rows, seq_lens)
    want = wk.decode_attention(
        q_rot,
        k_pool,
        v_pool,
        *table,
        torch.full_like(q, NAN),
        0.125,
        wk.DecodePlan(splits, block_n=16),
    )
    rope = wk.DecodeRope(positions, cache, k, v, loc)
    got = wk.decode_attention(
        q,
        pool.k_buffer,
        pool.v_buffer,
        *table,
        torch.full_like(q, NAN),
        0.125,
        wk.DecodePlan(splits, block_n=16, rope=rope),
    )
    assert_close(got, want, TOL[dtype])
    assert torch.equal(pool.k_buffer[loc[live]], k_pool[loc[live]])
    assert torch.equal(pool.v_buffer[loc[live]], v_pool[loc[live]])
    assert pool.k_buffer[loc[1]].isnan().all() and pool.v_buffer[loc[1]].isnan().all()


@interpreted
def test_decode_attention_refuses_rope_with_a_shared_prefix() -> None:
    """The prefix kernel reads q before the split kernel would rotate it."""
    pool = make_pool([8], [8], 16, 2, 64, torch.float32)
    q, k = torch.randn(1, 8, 64), torch.randn(1, 2, 64)
    zeros = torch.zeros(1, dtype=torch.int32)
    shared = wk.SharedPrefix(torch.full((1, 16), -1, dtype=torch.int32), zeros, zeros, 1)
    cache = wk.cos_sin_cache(torch.ones(32), 16)
    rope = wk.DecodeRope(torch.tensor([7]), cache, k, k.clone(), torch.tensor([7]))
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor([8]))
    with pytest.raises(ValueError, match="rope cannot go with shared"):
        wk.decode_attention(
            q,
            *args,
            torch.empty_like(q),
            0.1,
            wk.DecodePlan(2, kv_starts=zeros, shared=shared, rope=rope),
        )


# us per decode call in CUDA graphs at kv 2048, bf16, 32 q / 8 kv heads, by split count, on the
# H200 (132 SMs; `benchmarks/kernel.py decode --splits`)
MEASURED_SPLITS = {
    1: {1: 53.3, 2: 30.9, 4: 18.6, 8: 12.9, 16: 10.2, 32: 10.3},
    4: {1: 55.3, 2: 32.5, 4: 22.2, 8: 18.1, 16: 17.4},
    8: {1: 58.4, 2: 37.3, 4: 29.3, 8: 28.1, 16: 29.5},
    16: {1: 64.1, 2: 47.8, 4: 46.4, 8: 48.3, 16: 49.3},
    24: {1: 74.0, 2: 60.7, 4: 68.3, 8: 66.2, 16: 67.2},
    32: {1: 79.8, 2: 76.1, 4: 80.6, 8: 83.7, 16: 85.0},
    40: {1: 93.1, 2: 112.8, 4: 101.6, 8: 100.8, 16: 102.6},
    48: {1: 103.4, 2: 117.4, 4: 114.4, 8: 118.1, 16: 120.5},
    56: {1: 121.2, 2: 127.0, 4: 135.1, 8: 135.3, 16: 138.2},
    64: {1: 133.3, 2: 139.7, 4: 147.8, 8: 152.6, 16: 156.5},
    80: {1: 209.6, 2: 180.5, 4: 182.0, 8: 187.4, 16: 193.4},
    96: {1: 216.3, 2: 203.8, 4: 215.2, 8: 221.7, 16: 230.3},
    128: {1: 256.8, 2: 266.8, 4: 282.2, 8: 290.4, 16: 303.5},
}


# the same on an fp8 (e4m3) pool at the runtime's launch (`benchmarks/kernel.py decode --fp8
# --splits`)
MEASURED_SPLITS_FP8 = {
    1: {1: 40.2, 2: 26.4, 4: 18.4, 8: 14.1, 16: 12.3, 32: 13.1},
    4: {1: 43.5, 2: 28.7, 4: 20.8, 8: 18.8, 16: 20.1, 32: 20.6},
    8: {1: 45.9, 2: 31.6, 4: 25.9, 8: 27.1, 16: 27.8, 32: 28.2},
    16: {1: 49.2, 2: 39.3, 4: 42.1, 8: 40.4, 16: 43.1, 32: 43.6},
    24: {1: 57.6, 2: 47.0, 4: 50.1, 8: 52.8, 16: 57.8, 32: 59.1},
    32: {1: 60.1, 2: 68.1, 4: 64.5, 8: 66.1, 16: 72.4, 32: 74.8},
    48: {1: 72.6, 2: 78.7, 4: 85.0, 8: 91.0, 16: 101.0, 32: 105.4},
    64: {1: 124.6, 2: 106.7, 4: 111.8, 8: 116.9, 16: 130.3, 32: 137.6},
    96: {1: 131.8, 2: 141.5, 4: 155.1, 8: 168.1, 16: 189.2, 32: 200.5},
    128: {1: 186.2, 2: 192.8, 4: 202.0, 8: 218.3, 16: 248.4, 32: 264.6},
    256: {1: 348.4, 2: 353.2, 4: 384.7, 8: 420.8, 16: 485.3, 32: 520.9},
    512: {1: 649.8, 2: 684.1, 4: 758.4, 8: 839.7, 16: 966.9, 32: 1035.3},
}


@pytest.mark.parametrize(
    "fp8, bsz",
    [(False, b) for b in sorted(MEASURED_SPLITS)]
    + [(True, b) for b in sorted(MEASURED_SPLITS_FP8)],
)
def test_decode_splits_are_the_measured_best(fp8: bool, bsz: int) -> None:
    """At every measured batch the split count picked runs within 2% of the fastest one; on an
    fp8 pool at batch 1 within 7% (32 splits against 16: the model's shape cannot tell them
    apart there)."""
    from weft.kernels.splits import decode_num_kv_splits

    times = (MEASURED_SPLITS_FP8 if fp8 else MEASURED_SPLITS)[bsz]
    pick = decode_num_kv_splits(bsz, 8, 2048, 132, fp8=fp8)
    assert pick in times, (bsz, pick)
    slack = 1.07 if fp8 and bsz == 1 else 1.02
    assert times[pick] <= slack * min(times.values()), (bsz, pick, times)


def test_decode_splits_are_powers_of_2_within_the_context() -> None:
    from weft.kernels.splits import MIN_SPLIT_TOKENS, decode_num_kv_splits

    for context in (16, 64, 200, 2048, 131072):
        cap = max(1, min(64, context // MIN_SPLIT_TOKENS))
        for bsz in (1, 3, 17, 64, 100, 1000):
            for hkv, sms in ((8, 132), (1, 132), (2, 16)):
                for fp8 in (False, True):
                    splits = decode_num_kv_splits(bsz, hkv, context, sms, fp8=fp8)
                    assert 1 <= splits <= cap and splits & (splits - 1) == 0, (context, bsz)


EXTEND_CASES = [
    # heads, kv heads, head dim, page size, dtype, prefix lens, extend lens, block_m, block_n
    (4, 4, 64, 1, torch.float32, [0, 0, 0], [1, 20, 37], 16, 16),
    (8, 2, 128, 16, torch.float16, [16, 0, 45], [30, 1, 17], 16, 16),
    (8, 1, 64, 16, torch.float32, [100, 3, 0], [1, 1, 2], 16, 16),
    (8, 2, 64, 1, torch.float32, [7, 33, 5], [40, 3, 0], 32, 16),
    (4, 1, 128, 16, torch.float16, [70], [70], None, None),  # default block sizes
    (8, 1, 64, 16, torch.float16, [0, 21, 16, 40], [0, 1, 33, 18], 32, 16),
    (6, 2, 64, 16, torch.float32, [9, 0, 20], [13, 5, 1], 16, 16),  # G = 3: 5 tokens x 3 + 1 row
]


def extend_args(
    heads: int, hkv: int, dim: int, page: int, dtype: torch.dtype, prefix: list[int], ext: list[int]
) -> tuple[Any, ...]:
    """extend_attention's inputs up to `out`: random q/k/v for the new tokens, a pool holding the
    prefixes (the new tokens' pool slots stay NaN: their K/V must come from k/v, not the pool)."""
    lens = [max(p + e, 1) for p, e in zip(prefix, ext, strict=True)]
    pool = make_pool(lens, prefix, page, hkv, dim, dtype)
    tokens = sum(ext)
    q = torch.randn(tokens, heads, dim).to(dtype)
    k = torch.randn(tokens, hkv, dim).to(dtype)
    v = torch.randn(tokens, hkv, dim).to(dtype)
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    return (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, *lens_args)


@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize(
    "heads, hkv, dim, page, dtype, prefix, ext, block_m, block_n", EXTEND_CASES
)
@interpreted
def test_extend_attention(
    heads: int,
    hkv: int,
    dim: int,
    page: int,
    dtype: torch.dtype,
    prefix: list[int],
    ext: list[int],
    block_m: int | None,
    block_n: int | None,
    pack_gqa: bool,
) -> None:
    """Packed (a kv head's q heads in one program, rows = token x head) and one program per q
    head; G = 1 packed is one head per program."""
    args = extend_args(heads, hkv, dim, page, dtype, prefix, ext)
    out = torch.full(args[0].shape, NAN, dtype=dtype)
    launch = {"block_m": block_m, "block_n": block_n, "pack_gqa": pack_gqa}
    wk.extend_attention(*args, out, dim**-0.5, max(ext), **launch)
    assert_close(out, ref.extend_attention_ref(*args, dim**-0.5), TOL[dtype])


@pytest.mark.parametrize("pack_gqa, dtype", [(False, torch.float32), (True, torch.float16)])
@interpreted
def test_extend_attention_runs_a_work_list(pack_gqa: bool, dtype: torch.dtype) -> None:
    """With `work` (extend_work's query blocks, heaviest first; requests of 0 new tokens give
    none), the programs run just those blocks: the reference's output, every row written; the
    same in another order."""
    heads, hkv, dim, page = 8, 2, 32, 4
    prefix, ext = [20, 0, 9, 33, 5], [5, 40, 0, 1, 17]
    args = extend_args(heads, hkv, dim, page, dtype, prefix, ext)
    expected = ref.extend_attention_ref(*args, dim**-0.5)
    block_m = 16
    block_t = wk.extend_block_tokens(dtype, dtype, dim, heads // hkv, pack_gqa, block_m)
    assert block_t == (16 // 4 if pack_gqa else 16)
    items = wk.extend_work(ext, prefix, block_t)
    pairs = list(zip(items[::2], items[1::2], strict=True))
    assert sorted(pairs) == [(b, m) for b, n in enumerate(ext) for m in range(-(-n // block_t))]
    keys = [prefix[b] + min(ext[b], (m + 1) * block_t) for b, m in pairs]
    assert keys == sorted(keys, reverse=True)  # the longest walks first
    for order in (items, [x for pair in reversed(pairs) for x in pair]):
        work = torch.tensor(order, dtype=torch.int32).view(-1, 2)
        out = torch.full(args[0].shape, NAN, dtype=dtype)
        wk.extend_attention(*args, out, dim**-0.5, block_m=block_m, pack_gqa=pack_gqa, work=work)
        assert_close(out, expected, TOL[dtype])


@interpreted
def test_extend_attention_packs_heads_only_where_they_fit() -> None:
    """32 q heads on one kv head: 16-row blocks run one program per q head (pack_gqa=True is
    refused there); 32-row blocks can pack them, one new token per program."""
    prefix, ext = [5, 17, 0], [2, 0, 3]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    pool = make_pool(lens, prefix, 16, 1, 32, torch.float32)
    q, k, v = (torch.randn(5, h, 32) for h in (32, 1, 1))
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    args = (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, *lens_args)
    expected = ref.extend_attention_ref(*args, 0.2)
    for block_m, pack in ((16, False), (32, True)):
        out = torch.full_like(q, NAN)
        wk.extend_attention(*args, out, 0.2, max(ext), block_m=block_m, block_n=16, pack_gqa=pack)
        assert_close(out, expected, 1e-5)
    with pytest.raises(AssertionError, match="cannot pack"):
        wk.extend_attention(*args, out, 0.2, 3, block_m=16, pack_gqa=True)


@pytest.mark.parametrize(
    "hkv, dim, src, dst",
    [(2, 64, torch.float32, torch.float32), (3, 128, torch.float32, torch.float16)],
)
@interpreted
def test_store_kv(hkv: int, dim: int, src: torch.dtype, dst: torch.dtype) -> None:
    tokens, num_slots = 9, 40
    qkv = torch.randn(tokens, (4 + 2 * hkv) * dim).to(src)  # k, v as views into a fused output
    k = qkv[:, 4 * dim : (4 + hkv) * dim].view(tokens, hkv, dim)
    v = qkv[:, (4 + hkv) * dim :].view(tokens, hkv, dim)
    k_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dst)
    v_buffer = torch.full((num_slots, hkv, dim), NAN, dtype=dst)
    loc = torch.randperm(num_slots)[:tokens]
    k_want, v_want = k_buffer.clone(), v_buffer.clone()
    ref.store_kv_ref(k, v, k_want, v_want, loc)
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    for got, want in ((k_buffer, k_want), (v_buffer, v_want)):
        assert torch.equal(got.isnan(), want.isnan()), "a slot outside loc was written"
        assert torch.equal(got[loc], want[loc])


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16, torch.bfloat16])
@interpreted
def test_attention_reads_an_fp8_pool(q_dtype: torch.dtype) -> None:
    """kv_cache_dtype fp8_e4m3: decode and extend read the fp8 pool upcast to the queries' dtype
    (the references upcast the same bytes); unowned slots stay NaN, so stray reads still show."""
    lens = [5, 40, 17]
    pool = make_pool(lens, lens, 16, 2, 64, FP8)
    q = torch.randn(3, 8, 64).to(q_dtype)
    out = torch.full((3, 8, 64), NAN, dtype=q_dtype)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    wk.decode_attention(q, *args, out, 0.125, wk.DecodePlan(2, block_n=16))
    assert_close(out, ref.decode_attention_ref(q, *args, 0.125), TOL[q_dtype])
    if q_dtype == torch.bfloat16:
        # NOTE: decode and extend's prefix take an fp8 pool's dots in float16 (FP16_DOTS),
        # extend's new tokens in the queries' dtype: the interpreter's bfloat16 dots are wrong
        # (tests/gpu checks extend in bf16)
        return
    prefix, ext = [16, 0, 30], [3, 5, 1]
    pool = make_pool([p + e for p, e in zip(prefix, ext, strict=True)], prefix, 16, 2, 64, FP8)
    tokens = sum(ext)
    q, k, v = (torch.randn(tokens, h, 64).to(q_dtype) for h in (8, 2, 2))
    ext_t = torch.tensor(ext)
    lens_args = (torch.tensor(prefix), ext_t, torch.cumsum(ext_t, 0) - ext_t)
    ext_args = (q, k, v, pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows)
    expected = ref.extend_attention_ref(*ext_args, *lens_args, 0.125)
    for pack_gqa in (True, False):
        out = torch.full((tokens, 8, 64), NAN, dtype=q_dtype)
        launch = {"block_m": 16, "block_n": 16, "pack_gqa": pack_gqa}
        wk.extend_attention(*ext_args, *lens_args, out, 0.125, max(ext), **launch)
        assert_close(out, expected, TOL[q_dtype])


@interpreted
def test_fp8_v_staging_is_cuda_only() -> None:
    """The staged V conversion is inline PTX: asked for off CUDA (or on a 16-bit pool), a
    ValueError that says what it needs."""
    lens = [5, 9]
    pool = make_pool(lens, lens, 16, 2, 64, FP8)
    q = torch.randn(2, 8, 64, dtype=torch.float16)
    args = (pool.k_buffer, pool.v_buffer, pool.req_to_token, pool.req_rows, torch.tensor(lens))
    with pytest.raises(ValueError, match="fp8_v_staged needs an fp8 pool, a 16-bit q, CUDA"):
        wk.decode_attention(
            q, *args, torch.empty_like(q), 0.125, wk.DecodePlan(2, fp8_v_staged=True)
        )


@interpreted
def test_store_kv_into_an_fp8_pool_saturates() -> None:
    """Values past e4m3's largest finite value (448) are stored as +-448, never NaN. (The inputs are
    fp8-representable after clamping: the interpreter's fp32 -> fp8 rounding is not the GPU's.)"""
    k = torch.randn(6, 2, 32).to(FP8).float()
    v = torch.randn(6, 2, 32).to(FP8).float()
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -3e4])
    v[5, 1, :2] = torch.tensor([float("inf"), -512.0])
    k_buffer, v_buffer = (
        torch.full((20, 2, 32), NAN, dtype=FP8),
        torch.full((20, 2, 32), NAN, dtype=FP8),
    )
    loc = torch.randperm(20)[:6]
    k_want, v_want = k_buffer.clone(), v_buffer.clone()
    ref.store_kv_ref(k, v, k_want, v_want, loc)
    wk.store_kv(k, v, k_buffer, v_buffer, loc)
    for got, want in ((k_buffer, k_want), (v_buffer, v_want)):
        assert not got[loc].float().isnan().any()
        assert torch.equal(got.float().isnan(), want.float().isnan())
        assert torch.equal(got[loc].float(), want[loc].float())
    assert k_buffer[loc[0], 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]


NORM_CASES = [(64, torch.float32), (96, torch.float16), (1000, torch.bfloat16)]


@pytest.mark.parametrize("hidden, dtype", NORM_CASES)
@interpreted
def test_rmsnorm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden + 8).to(dtype)[:, 4 : 4 + hidden]  # a row stride past the width
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    out = torch.full((7, hidden), NAN, dtype=dtype)
    wk.rmsnorm(x, weight, 1e-6, out=out)
    assert_close(out, ref.rmsnorm_ref(x, weight, 1e-6), TOL[dtype] * 3)


@pytest.mark.parametrize("hidden, dtype", NORM_CASES)
@interpreted
def test_fused_add_rmsnorm(hidden: int, dtype: torch.dtype) -> None:
    x = torch.randn(7, hidden).to(dtype)
    residual = torch.randn(7, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    x_want, res_want = ref.fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    wk.fused_add_rmsnorm(x, residual, weight, 1e-5)
    assert_close(residual, res_want, TOL[dtype])
    assert_close(x, x_want, TOL[dtype] * 3)
    # x is the norm of the sum as stored (rounded to the dtype), not of the float32 sum
    assert_close(x, ref.rmsnorm_ref(residual, weight, 1e-5), TOL[dtype])


@pytest.mark.parametrize("inter, dtype", [(64, torch.float32), (1500, torch.bfloat16)])
@interpreted
def test_silu_and_mul(inter: int, dtype: torch.dtype) -> None:
    gate_up = (2 * torch.randn(5, 2 * inter)).to(dtype)
    out = torch.full((5, inter), NAN, dtype=dtype)
    wk.silu_and_mul(gate_up, out=out)
    assert_close(out, ref.silu_and_mul_ref(gate_up), TOL[dtype])


@pytest.mark.parametrize("vocab", [1, 2047, 2048, 5000, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@interpreted
def test_argmax_rows(vocab: int, dtype: torch.dtype) -> None:
    x = torch.randn(4, vocab + 3).to(dtype)[:, :vocab]  # a row stride wider than the row
    x[1] = x[1].round()  # many equal maxima: the first one counts
    x[2] = float("-inf")  # nothing but -inf: index 0, as torch gives
    x[3, vocab // 2] = float("inf")
    x[3, vocab - 1] = NAN  # a NaN wins over +inf (torch.argmax)
    out = torch.full((4,), -7, dtype=torch.int64)
    wk.argmax_rows(x, out=out)
    assert out.tolist() == x.float().argmax(-1).tolist()
    assert wk.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="1 to"):
        wk.argmax_rows(x[:, :0])


ROPE_CASES = [
    (64, 64, True, torch.float32),
    (128, 128, False, torch.float16),
    (64, 32, True, torch.bfloat16),
]


@pytest.mark.parametrize("dim, rot, neox, dtype", ROPE_CASES)
@interpreted
def test_rotary_embedding(dim: int, rot: int, neox: bool, dtype: torch.dtype) -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    cache = wk.cos_sin_cache(inv_freq, 300)
    positions = torch.randint(0, 300, (6,))
    qk = torch.randn(6, 10 * dim).to(dtype)  # q and k as views into one fused projection
    q, k = qk[:, : 8 * dim].view(6, 8, dim), qk[:, 8 * dim :].view(6, 2, dim)
    q_want, k_want = ref.rotary_embedding_ref(positions, q, k, cache, is_neox=neox)
    wk.rotary_embedding(positions, q, k, cache, is_neox=neox)
    assert_close(q, q_want, TOL[dtype])
    assert_close(k, k_want, TOL[dtype])


@pytest.mark.parametrize(
    "neox, dtype, pool_dtype",
    [(True, torch.float32, torch.float32), (False, torch.float16, torch.float16),
     (True, torch.float32, FP8)],
)  # fmt: skip
@interpreted
def test_rotary_stores_k_and_v_as_store_kv_does(
    neox: bool, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """rotary_embedding(kv_store=...) leaves q, k and the pool exactly as rotary_embedding then
    store_kv do (an fp8 pool saturated), and writes no slot outside loc."""
    dim, hkv, tokens, slots = 64, 2, 7, 30
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    cache = wk.cos_sin_cache(inv_freq, 300)
    positions = torch.randint(0, 300, (tokens,))
    qkv = (torch.randn(tokens, 12 * dim) * 3).to(dtype)  # q, k, v as views of one projection
    qkv[0, 8 * dim : 8 * dim + 4] = torch.tensor([1000.0, -1000.0, 3e4, -500.0])  # past fp8 max
    qkv[3, 11 * dim] = 700.0
    loc = torch.randperm(slots)[:tokens]
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q, k = x[:, : 8 * dim].view(tokens, 8, dim), x[:, 8 * dim : 10 * dim].view(tokens, hkv, dim)
        v = x[:, 10 * dim :].view(tokens, hkv, dim)
        k_buf = torch.full((slots, hkv, dim), NAN).to(pool_dtype)
        v_buf = torch.full((slots, hkv, dim), NAN).to(pool_dtype)
        if fused:
            wk.rotary_embedding(
                positions, q, k, cache, is_neox=neox, kv_store=(v, k_buf, v_buf, loc)
            )
        else:
            wk.rotary_embedding(positions, q, k, cache, is_neox=neox)
            wk.store_kv(k, v, k_buf, v_buf, loc)
        outs.append((x, k_buf.float(), v_buf.float()))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert torch.equal(got.isnan(), want.isnan()), "a slot outside loc was written"
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    if pool_dtype == FP8:  # v[3] head 1 dim 0 was 700: saturated, not NaN
        assert outs[1][2][loc[3], 1, 0].item() == 448.0


@interpreted
def test_rotary_store_needs_the_whole_head_rotated() -> None:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    cache = wk.cos_sin_cache(inv_freq, 10)
    q, k, v = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    bufs = (v, torch.zeros(4, 2, 64), torch.zeros(4, 2, 64), torch.arange(2))
    with pytest.raises(ValueError, match="kv_store needs the rotary dim 32 = 64"):
        wk.rotary_embedding(torch.arange(2), q, k, cache, kv_store=bufs)


@interpreted
def test_rotary_matches_runtime_llama31() -> None:
    """The kernel with a cache built from the runtime's Llama 3.1 inv_freq equals its module."""
    from weft.runtime.models.layers import RotaryEmbedding, rope_inv_freq

    params = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    module = RotaryEmbedding(64, 20000, params)
    positions = torch.tensor([0, 1, 77, 4096, 9000, 19999])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    q_want, k_want = module(positions, q, k)
    wk.rotary_embedding(positions, q, k, wk.cos_sin_cache(rope_inv_freq(64, params), 20000))
    assert_close(q, q_want, 1e-5)
    assert_close(k, k_want, 1e-5)


@pytest.mark.parametrize(
    "vocab, width, rows, dtype",
    [
        (100, 4, None, torch.float32),
        (77, 2, [3, 0], torch.bfloat16),
        (3000, 94, [1], torch.float16),
    ],
)
@interpreted
def test_apply_token_bitmask(
    vocab: int, width: int, rows: list[int] | None, dtype: torch.dtype
) -> None:
    logits = torch.randn(4, vocab).to(dtype)
    num_masks = 4 if rows is None else len(rows)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_masks, width), dtype=torch.int32)
    row_t = None if rows is None else torch.tensor(rows)
    want = ref.apply_token_bitmask_ref(logits, bitmask, row_t)
    wk.apply_token_bitmask(logits, bitmask, row_t)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@interpreted
def test_kv_page_indices(page: int, index_dtype: torch.dtype) -> None:
    lens = [1, 17, 300, 5, 64]  # 300 tokens of page 1: more pages than one block of the kernel
    pool = make_pool(lens, lens, page, 1, 4, torch.float32)
    num_pages = [-(-n // page) for n in lens]
    indptr = torch.tensor([0, *num_pages], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = int(indptr[-1])
    out = torch.full((total + 3,), -7, dtype=torch.int32)  # poisoned, and 3 past the end
    table, rows = pool.req_to_token.to(index_dtype), pool.req_rows.to(index_dtype)
    wk.kv_page_indices(table, rows, indptr, out, page)
    expected = ref.kv_page_indices_ref(pool.req_to_token, pool.req_rows, num_pages, page)
    assert torch.equal(out[:total], expected)
    assert (out[total:] == -7).all(), "wrote past the last page"
