"""Masks prefetched straight into a bound bitmask row (fill_bitmask(..., bind=True)): bit-identical
to the copied path, no copy on the caller's thread, and no write after release() or into a clone's
row; apply_bitmask with mask_rows."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_constrain_prefetch import corpus, row, sync_backend
from test_constrain_support import STOP, VOCAB, allowed, backend, encode

from weft.constrain import GrammarSpec, allocate_bitmask, apply_bitmask, llguidance_prefetch
from weft.constrain.base import GrammarMatcher
from weft.constrain.llguidance_prefetch import MaskWorker

SLOTS = 8
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}}}


class _Held:
    """A library matcher whose mask computation waits for `go` first."""

    def __init__(self, matcher: Any, go: threading.Event) -> None:
        self._m, self._go = matcher, go

    def unsafe_compute_mask_ptr(self, address: int, size: int) -> None:
        self._go.wait()
        self._m.unsafe_compute_mask_ptr(address, size)


class HeldWorker(MaskWorker):
    """A mask worker whose jobs wait while `go` is clear (a prefetch that is slow to finish)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def submit(self, matcher: Any, out: Any, finish: Any) -> llguidance_prefetch.Job:
        return super().submit(_Held(matcher, self.go), out, finish)


@pytest.fixture
def held() -> Iterator[HeldWorker]:
    worker = HeldWorker()
    yield worker
    worker.go.set()  # let queued jobs finish: they hold matchers


@pytest.fixture
def caller_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row copies (ctypes.memmove) made on the test's thread, by size in bytes."""
    sizes: list[int] = []
    me, memmove = threading.get_ident(), ctypes.memmove

    def counted(dst: Any, src: Any, n: int) -> Any:
        if threading.get_ident() == me:
            sizes.append(n)
        return memmove(dst, src, n)

    monkeypatch.setattr(ctypes, "memmove", counted)
    return sizes


def fill_bound(m: GrammarMatcher, bitmask: torch.Tensor, slot: int) -> torch.Tensor:
    m.fill_bitmask(bitmask, slot, bind=True)
    return bitmask[slot].clone()


def json_matchers(
    schema: Any = SCHEMA, worker: MaskWorker | None = None
) -> tuple[GrammarMatcher, GrammarMatcher]:
    """(a prefetching matcher, on `worker` if given; the synchronous one)."""
    spec = GrammarSpec.json_schema(schema)
    fast = backend("llguidance")
    if worker is not None:
        fast._prefetch = (worker, False)  # type: ignore[attr-defined]
    return fast.compile(spec).matcher(), sync_backend().compile(spec).matcher()


def test_in_place_masks_equal_the_copied_ones_over_a_schema_walk(caller_copies: list[int]) -> None:
    """Every step of the corpus' JSON texts, each matcher bound to its own slot of one bitmask
    (as the runner does): the mask without prefetch, bit for bit; most fills copy nothing."""
    bitmask = allocate_bitmask(SLOTS, VOCAB)
    steps = in_place = 0
    walks = [(spec, text) for spec, texts in corpus() if spec.kind == "json_schema"
             for text in texts[:2]][:60]  # fmt: skip
    for n, (spec, text) in enumerate(walks):
        a = backend("llguidance").compile(spec).matcher()
        b = sync_backend().compile(spec).matcher()
        slot = n % SLOTS
        for token in [*encode(text), STOP]:
            before = len(caller_copies)
            mask = fill_bound(a, bitmask, slot)
            in_place += len(caller_copies) == before and a._in_place  # type: ignore[attr-defined]
            assert torch.equal(mask, row(b)), (spec.spec, text, steps)
            steps += 1
            if not allowed(mask[None], token):
                break
            assert a.accept_token(token) == b.accept_token(token)
        a.release()
    assert steps > 500 and in_place > steps // 2, (steps, in_place)


def test_a_fill_of_the_bound_row_only_waits(caller_copies: list[int]) -> None:
    a, b = json_matchers()
    bitmask = allocate_bitmask(SLOTS, VOCAB)
    ids = encode('{"title": "Launch day"}')
    fill_bound(a, bitmask, 3)  # the first fill binds (and copies)
    for token in ids[:6]:
        assert a.accept_token(token) and b.accept_token(token)
        caller_copies.clear()
        assert torch.equal(fill_bound(a, bitmask, 3), row(b))
        assert caller_copies == [] or a.forced_tokens(), caller_copies
    a.rollback(2)  # joins, forgets the prefetched mask: computed again, same bits
    b.rollback(2)
    assert torch.equal(fill_bound(a, bitmask, 3), row(b))
    assert torch.equal(fill_bound(a, bitmask, 5), row(b)), "another slot: copied"
    assert a.accept_token(ids[4]) and b.accept_token(ids[4])
    a._join()  # type: ignore[attr-defined]
    assert torch.equal(bitmask[5], row(b)), "the prefetch wrote the newly bound slot"


def test_release_stops_a_prefetch_in_flight_from_writing_the_row(held: HeldWorker) -> None:
    """A request ends (or is retracted) while its prefetch is queued; its slot goes to a request
    whose mask is written on the caller's thread: the stale job must not overwrite it, and
    release must not wait for the job. Without release() the job does (checked last)."""
    held.go.set()  # the first masks (prefetched at creation) are computed
    a, b = json_matchers(worker=held)
    bitmask = allocate_bitmask(SLOTS, VOCAB)
    fill_bound(a, bitmask, 3)
    held.go.clear()
    assert a.accept_token(encode("{")[0]) and b.accept_token(encode("{")[0])
    assert a._job is not None  # type: ignore[attr-defined]
    releasing = threading.Thread(target=a.release)
    releasing.start()
    releasing.join(timeout=5)
    assert not releasing.is_alive(), "release waited for the held job"
    regex = sync_backend().compile(GrammarSpec.regex(r"[0-9]{1,4}")).matcher()
    theirs = fill_bound(regex, bitmask, 3)  # the slot's next owner, no prefetch
    held.go.set()
    a._join()  # type: ignore[attr-defined]
    assert torch.equal(bitmask[3], theirs), "a released matcher's job wrote the row"
    assert torch.equal(row(a), row(b)), "its mask was kept (for a retracted request)"
    # the control: without release, the job writes the row
    c, _ = json_matchers(worker=held)
    fill_bound(c, bitmask, 3)
    held.go.clear()
    assert c.accept_token(encode("{")[0]) and c._job is not None  # type: ignore[attr-defined]
    assert torch.equal(fill_bound(regex, bitmask, 3), theirs)
    held.go.set()
    c._join()  # type: ignore[attr-defined]
    assert not torch.equal(bitmask[3], theirs)
    c.release()


def test_a_clone_does_not_share_the_bound_row() -> None:
    """fork / n>1: the copy starts unbound; its prefetches never reach the original's row."""
    a, b = json_matchers()
    bitmask = allocate_bitmask(SLOTS, VOCAB)
    prefix = encode('{"title": "')
    for token in prefix:
        assert a.accept_token(token) and b.accept_token(token)
    mine = fill_bound(a, bitmask, 2)
    clone = a.copy()
    for token in encode("Launch"):
        assert clone.accept_token(token)
    clone._join()  # type: ignore[attr-defined]
    assert torch.equal(bitmask[2], mine), "the clone's prefetch wrote the original's row"
    assert torch.equal(fill_bound(a, bitmask, 2), row(b))
    ref = b.copy()
    for token in encode("Launch"):
        assert ref.accept_token(token)
    assert torch.equal(fill_bound(clone, bitmask, 6), row(ref))
    assert torch.equal(bitmask[2], mine)


def test_without_bind_nothing_writes_the_row_later() -> None:
    """The old contract: a caller may reuse and overwrite its bitmask between fills."""
    a, b = json_matchers()
    bitmask = allocate_bitmask(1, VOCAB)
    fill_bound(a, bitmask, 0)
    a.fill_bitmask(bitmask, 0)  # unbinds
    for token in encode('{"title": "x"}'):
        bitmask.fill_(0)
        assert a.accept_token(token) and b.accept_token(token)
        a._join()  # type: ignore[attr-defined]
        assert int(bitmask.abs().sum()) == 0
        a.fill_bitmask(bitmask, 0)
        assert torch.equal(bitmask[0], row(b))


@pytest.mark.parametrize("device_rows", [False, True], ids=["all-rows", "some-rows"])
def test_apply_bitmask_with_mask_rows(device_rows: bool) -> None:
    """Mask row mask_rows[r] applies to logits row rows[r]: the same as gathering those rows."""
    torch.manual_seed(7)
    vocab = 100
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, 4), dtype=torch.int32)
    logits = torch.randn(4, vocab)
    rows = torch.tensor([3, 0, 2]) if device_rows else None
    mask_rows = torch.tensor([5, 1, 4]) if device_rows else torch.tensor([2, 0, 5, 1])
    want = logits.clone()
    apply_bitmask(want, bitmask[mask_rows], rows=rows)
    apply_bitmask(logits, bitmask, rows=rows, mask_rows=mask_rows)
    assert torch.equal(logits, want)
    if rows is not None:
        assert torch.isinf(logits[3]).any() and not torch.isinf(logits[1]).any()
