"""GrammarQueue: a backend that cannot start refuses constrained requests with the reason (once
built, never retried per request); scan/take hand out finished compiles by position."""

from __future__ import annotations

import time
from typing import Any

import pytest

from weft.constrain import GrammarError, GrammarSpec
from weft.runtime.config import EngineConfig
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.scheduler.grammar import GrammarQueue
from weft.runtime.scheduler.request import Req


def req(rid: str) -> Req:
    return Req(rid=rid, input_ids=[1, 2], params=SamplingParams(), max_new_tokens=4)


def test_a_backend_that_cannot_start_is_a_grammar_error_not_a_crash() -> None:
    queue = GrammarQueue(EngineConfig(), tokenizer=object(), vocab_size=10, stop_ids=frozenset({2}))
    with pytest.raises(GrammarError, match="constrained decoding is unavailable: the llguidance"):
        queue.submit(req("a"), GrammarSpec.regex("[ab]+"))
    with pytest.raises(GrammarError, match="backend failed to start"):
        queue.submit(req("b"), GrammarSpec.regex("[ab]+"))
    assert queue.pending == []


def test_start_backend_builds_it_once_and_remembers_a_failure(default_model_dir: Any) -> None:
    from weft.runtime.loader import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    queue = GrammarQueue(EngineConfig(), tok, len(tok), frozenset({tok.eos_token_id}))
    queue.start_backend()
    compiler = queue.compiler
    assert compiler is not None
    queue.submit(req("a"), GrammarSpec.regex("[ab]+"))
    assert queue.compiler is compiler  # not rebuilt
    queue.close()
    broken = GrammarQueue(EngineConfig(), tokenizer=object(), vocab_size=10, stop_ids=frozenset())
    broken.start_backend()  # no raise: the reason waits for the first constrained request
    with pytest.raises(GrammarError, match="backend failed to start"):
        broken.submit(req("b"), GrammarSpec.regex("[ab]+"))


def test_scan_then_take_by_position(default_model_dir: Any) -> None:
    from weft.runtime.loader import load_tokenizer

    tok = load_tokenizer(default_model_dir)
    queue = GrammarQueue(EngineConfig(), tok, len(tok), frozenset({tok.eos_token_id}))
    reqs = [req("ok"), req("bad"), req("ok2")]
    queue.submit(reqs[0], GrammarSpec.regex("[ab]+"))
    queue.submit(reqs[1], GrammarSpec.regex("(unclosed"))
    queue.submit(reqs[2], GrammarSpec.regex("x{2}"))
    deadline = time.monotonic() + 60
    ready, failed = queue.scan()
    while len(ready) + len(failed) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        ready, failed = queue.scan()
    assert ready == [0, 2] and [i for i, _ in failed] == [1]
    assert queue.pending == reqs  # scanning takes nothing
    got, bad = queue.take(ready, failed)
    assert got == [reqs[0], reqs[2]] and all(r.grammar is not None for r in got)
    assert bad[0][0] is reqs[1] and "Failed to compile" in bad[0][1]
    assert queue.pending == []
    queue.close()
