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
