"""llguidance mask prefetch: masks, forced tokens and state identical with and without it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import pytest
import torch
from test_constrain_support import (
    STOP,
    VOCAB,
    allowed,
    backend,
    encode,
    regexes,
    schemas,
    tokenizer,
)

from weft.constrain import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    allocate_bitmask,
    create_grammar_backend,
)


@functools.cache
def sync_backend() -> GrammarBackend:
    return create_grammar_backend("llguidance", tokenizer(), VOCAB, [STOP], prefetch_masks=False)


def corpus() -> list[tuple[GrammarSpec, list[str]]]:
    items = []
    for e in schemas():
        valid = [json.dumps(v, ensure_ascii=False) for v in e["valid"]] + e["valid_text"]
        items.append((GrammarSpec.json_schema(e["schema"]), valid))
    for r in regexes():
        items.append((GrammarSpec.regex(r["pattern"]), r["valid"]))
    return items


def row(m: GrammarMatcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, VOCAB)
    bitmask.fill_(0)
    m.fill_bitmask(bitmask, 0)
    return bitmask[0]


def test_masks_identical_over_the_corpus() -> None:
    """Every step of every valid corpus text: the same mask, forced tokens and answers."""
    steps = prefetched = 0
    for spec, texts in corpus():
        try:
            fast, slow = backend("llguidance").compile(spec), sync_backend().compile(spec)
        except GrammarError:
            continue
        for text in texts:
            a, b = fast.matcher(), slow.matcher()
            for token in [*encode(text), STOP]:
                prefetched += a._job is not None  # type: ignore[attr-defined]
                mask = row(a)
                assert torch.equal(mask, row(b)), (spec.spec, text, steps)
                assert torch.equal(mask, row(a)), "a repeat fill at the same state"
                assert a.error() == b.error() and a.forced_tokens() == b.forced_tokens()
                steps += 1
                if not allowed(mask[None], token):
                    break
                assert a.accept_token(token) == b.accept_token(token)
            assert a.is_terminated() == b.is_terminated()
    assert steps > 1000 and prefetched > steps // 2, (steps, prefetched)


def test_copy_rollback_and_accept_while_a_prefetch_runs() -> None:
    """State changes right after an accept (prefetch in flight) wait for it and stay exact."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}}}
    spec = GrammarSpec.json_schema(schema)
    a = backend("llguidance").compile(spec).matcher()
    b = sync_backend().compile(spec).matcher()
    ids = encode('{"title": "Launch day"}')
    for token in ids[:5]:
        assert a.accept_token(token) and b.accept_token(token)
    assert a._job is not None  # type: ignore[attr-defined]
    clone = a.copy()
    assert torch.equal(row(clone), row(b))
    a.rollback(2)
    b.rollback(2)
    assert a.forced_tokens() == b.forced_tokens()
    assert torch.equal(row(a), row(b))
    for token in ids[3:]:
        assert a.accept_token(token) and b.accept_token(token)  # no fill in between
    assert torch.equal(row(a), row(b))
    assert a.accept_token(STOP) and b.accept_token(STOP) and a.is_terminated()
    assert torch.equal(row(a), row(b))


def test_a_batch_of_queued_prefetches_gives_the_same_masks() -> None:
    """Many matchers advanced in lock step (a batch): their prefetches queue together behind one
    another; every mask equals the one computed without prefetch."""
    items = [(spec, text) for spec, texts in corpus()[:40] for text in texts[:1]]
    pairs, ids = [], []
    for spec, text in items:
        try:
            fast, slow = backend("llguidance").compile(spec), sync_backend().compile(spec)
        except GrammarError:
            continue
        pairs.append((fast.matcher(), slow.matcher()))
        ids.append([*encode(text), STOP])
    assert len(pairs) >= 30
    steps = queued = 0
    for t in range(max(map(len, ids))):
        for (a, b), tokens in zip(pairs, ids, strict=True):
            if t >= len(tokens) or a.is_terminated():
                continue
            queued += a._job is not None  # type: ignore[attr-defined]
            mask = row(a)
            assert torch.equal(mask, row(b)), (t, tokens)
            steps += 1
            if allowed(mask[None], tokens[t]):
                assert a.accept_token(tokens[t]) and b.accept_token(tokens[t])
    assert steps > 300 and queued > steps // 2, (steps, queued)


def test_prefetch_forced_prefetches_forced_states_with_the_same_masks() -> None:
    """With prefetch_forced (forced tokens sampled through masks, no jump-forward) a state with
    forced tokens has its mask prefetched too; without it, none is started there. The masks equal
    the synchronous backend's at every step either way."""
    spec = GrammarSpec.regex(r'\{"answer": "(yes|no)", "id": [0-9]{3}\}')
    forced_backend = create_grammar_backend(
        "llguidance", tokenizer(), VOCAB, [STOP], prefetch_forced=True
    )
    text = '{"answer": "yes", "id": 123}'
    for b, prefetch_forced in ((forced_backend, True), (backend("llguidance"), False)):
        m, ref = b.compile(spec).matcher(), sync_backend().compile(spec).matcher()
        forced_states = 0
        for token in [*encode(text), STOP]:
            if m.forced_tokens():
                forced_states += 1
                started = m._job is not None or m._ready  # type: ignore[attr-defined]
                assert started == prefetch_forced
            mask = row(m)
            assert torch.equal(mask, row(ref))
            assert allowed(mask[None], token)
            assert m.accept_token(token) and ref.accept_token(token)
        assert forced_states > 0


def walk_in_steps(pairs: list, ids: list[list[int]]) -> int:
    """Each step: every matcher's fill checked against the synchronous one, then every accept
    (as the scheduler's finish_step does them); the steps walked."""
    steps = 0
    for t in range(max(map(len, ids))):
        live = [(a, b, tokens[t]) for (a, b), tokens in zip(pairs, ids, strict=True)
                if t < len(tokens) and not a.is_terminated()]  # fmt: skip
        ok = []
        for a, b, token in live:
            mask = row(a)
            assert torch.equal(mask, row(b)), (t, token)
            steps += 1
            ok.append(allowed(mask[None], token))
        for (a, b, token), fine in zip(live, ok, strict=True):
            if fine:
                assert a.accept_token(token) and b.accept_token(token)
    return steps


def test_several_worker_threads_give_the_same_masks() -> None:
    """With 3 worker threads on one queue (tuning.grammar_mask_threads) every mask still equals
    the synchronous backend's, and jobs ran on more than one thread."""
    import threading

    fast = create_grammar_backend("llguidance", tokenizer(), VOCAB, [STOP], mask_threads=3)
    worker = fast._prefetch[0]  # type: ignore[attr-defined]
    assert worker.num_workers == 3
    threads: set[str] = set()
    submit = worker.submit

    def spy(matcher: object, out: object, finish: Callable[[int], None]) -> object:
        def traced(address: int) -> None:
            threads.add(threading.current_thread().name)
            finish(address)

        return submit(matcher, out, traced)

    worker.submit = spy
    pairs, ids = [], []
    for spec, texts in corpus()[:40]:
        try:
            pairs.append((fast.compile(spec).matcher(), sync_backend().compile(spec).matcher()))
        except GrammarError:
            continue
        ids.append([*encode(texts[0]), STOP])
    assert walk_in_steps(pairs, ids) > 300
    assert len(threads) > 1, threads


def test_a_bad_thread_count_is_refused() -> None:
    from weft.constrain import llguidance_prefetch

    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        llguidance_prefetch.MaskWorker(0)
    assert llguidance_prefetch.MaskWorker().num_workers == llguidance_prefetch.default_workers()
