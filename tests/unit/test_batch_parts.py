"""A large generate call reaches the scheduler in parts, and the scheduler's channel reads a
bounded number of bytes per pass, leaving the rest queued (the first step starts sooner)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from weft.runtime.ipc.channel import Channel
from weft.runtime.ipc.messages import BatchGenerateReq, Message, TokenizedGenerateReq
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server import request_parts as tm_mod
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.request_parts import batch_parts
from weft.runtime.server.tokenizer_manager import TokenizerManager


def req(rid: str, n: int) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, list(range(n)), SamplingParams(), 4)


def test_parts_cut_after_reaching_the_token_count() -> None:
    msgs = [req(str(i), n) for i, n in enumerate([5, 5, 1, 12, 3, 3, 3])]
    parts = batch_parts(msgs, 10)
    assert [[m.rid for m in p] for p in parts] == [["0", "1"], ["2", "3"], ["4", "5", "6"]]
    assert batch_parts(msgs, 1 << 20) == [msgs]  # a small call: one part
    assert batch_parts(msgs[:1], 1) == [msgs[:1]]


def test_a_large_call_arrives_in_parts_read_a_few_bytes_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request once, in order, over several messages; recv_all(max_bytes) reads at least
    one message and leaves the others in the socket for the next pass."""
    monkeypatch.setattr(tm_mod, "BATCH_PART_TOKENS", 100)
    channel = Channel(f"ipc://{tmp_path}/scheduler", {})
    info = ModelInfo(str(tmp_path), "llama", ("LlamaForCausalLM",), 4096, 1000, frozenset([2]))
    prompts = [[7 + i] * 30 for i in range(10)]  # 300 tokens: parts of 4, 4 and 2 requests

    async def submit_and_read() -> tuple[list[Message], list[Message]]:
        tm = TokenizerManager(None, info, 100_000, f"ipc://{tmp_path}/scheduler",
                              f"ipc://{tmp_path}/inbox", lambda: None)  # fmt: skip
        try:
            await tm.submit(GenerateInput(input_ids=prompts, sampling_params={"max_new_tokens": 2}))
            assert channel.poller.poll(5000)
            await asyncio.sleep(0.2)  # let the other parts arrive: the cap must leave them
            first = channel.recv_all(max_bytes=1)
            rest: list[Message] = []
            deadline = time.monotonic() + 10
            while len(first) + len(rest) < 3 and time.monotonic() < deadline:
                channel.poller.poll(100)  # (delivery is asynchronous: wait for all three)
                rest += channel.recv_all()
            return first, rest
        finally:
            await tm.close()

    try:
        first, rest = asyncio.run(submit_and_read())
        assert len(first) == 1 and len(rest) == 2
        reqs = [
            r for m in first + rest for r in (m.reqs if isinstance(m, BatchGenerateReq) else [m])
        ]
        assert [r.input_ids for r in reqs] == prompts
        assert [len(m.reqs) for m in first + rest if isinstance(m, BatchGenerateReq)] == [4, 4, 2]
    finally:
        channel.close()
