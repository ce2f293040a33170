"""The native /generate meta_info as SGLang's frontend reads it: logprob fields and their lengths,
whole and streamed (per-chunk output logprobs, cumulative counts), without a model."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from weft.lang.backends.native import merge_stream_meta
from weft.runtime.ipc.messages import FinishReason, StrOut, TokenOut
from weft.runtime.sampling_params import SamplingParams
from weft.runtime.server.generate_input import PromptSpec
from weft.runtime.server.http.native import _sse
from weft.runtime.server.output import ReqState, build_output

PROMPT = [11, 12, 13, 14]


def _state(**logprobs: Any) -> ReqState:
    spec = PromptSpec(
        index=0,
        rid="r",
        text=None,
        input_ids=PROMPT,
        params=SamplingParams(),
        return_logprob=True,
        logprob_start_len=logprobs.get("start", 0),
        top_logprobs_num=logprobs.get("top", 0),
        token_ids_logprob=[],
        return_text_in_logprobs=False,
        stream=True,
    )
    return ReqState(spec, PROMPT, "r", 0)


def _piece(ids: list[int], done: int, first: bool = False, last: bool = False) -> StrOut:
    """A detokenized step: `ids` new, `done` output tokens so far; the prompt's logprobs come
    with the first piece, as the scheduler sends them."""
    token = TokenOut(
        rid="r",
        new_ids=ids,
        finish=FinishReason("length", length=done) if last else None,
        prompt_tokens=len(PROMPT),
        cached_tokens=0,
        completion_tokens=done,
        output_logprobs=[(-0.25 * t, t) for t in ids],
        output_top_logprobs=[[(-0.25 * t, t)] for t in ids],
        input_logprobs=[(None, PROMPT[0])] + [(-1.0, t) for t in PROMPT[1:]] if first else [],
        input_top_logprobs=[[]] + [[(-1.0, t)] for t in PROMPT[1:]] if first else [],
        retractions=1,
    )
    return StrOut(text="".join(f"<{t}>" for t in ids), token=token)


STEPS = [([21], 1, True, False), ([22, 23], 3, False, False), ([], 3, False, False)]
STEPS += [([24], 4, False, True)]


def _deltas() -> list[dict[str, Any]]:
    state, outs = _state(top=1), []
    for ids, done, first, last in STEPS:
        state.add(_piece(ids, done, first, last), 0.0)
        outs.append(build_output(None, state, final=False))
    return outs


def test_final_meta_has_sglang_fields_and_lengths() -> None:
    state = _state(start=0, top=1)
    for ids, done, first, last in STEPS:
        state.add(_piece(ids, done, first, last), 0.0)
    meta = build_output(None, state, final=True)["meta_info"]
    assert meta["prompt_tokens"] == 0 + len(meta["input_token_logprobs"])  # start + entries
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == 4
    assert meta["output_token_logprobs_length"] == 4
    assert len(meta["output_top_logprobs"]) == 4 and len(meta["input_top_logprobs"]) == 4
    assert meta["output_token_logprobs"][1] == (-0.25 * 22, 22, None)
    assert meta["num_retractions"] == 1
    assert meta["weight_version"] == "default" and meta["reasoning_tokens"] == 0


def test_stream_deltas_carry_their_own_tokens_and_the_count_so_far() -> None:
    outs = _deltas()
    metas = [o["meta_info"] for o in outs]
    assert [len(m["output_token_logprobs"]) for m in metas] == [1, 2, 0, 1]
    assert [m["output_token_logprobs_length"] for m in metas] == [1, 3, 3, 4]
    assert [m["completion_tokens"] for m in metas] == [1, 3, 3, 4]
    assert [len(m["output_top_logprobs"]) for m in metas] == [1, 2, 0, 1]


async def _sse_events(incremental: bool) -> list[dict[str, Any]]:
    async def results() -> Any:
        for out in _deltas():
            yield out

    state: Any = SimpleNamespace(config=SimpleNamespace(incremental_streaming_output=incremental))
    events = []
    async for raw in _sse(results(), False, state):
        data = raw.decode()[len("data: ") :].strip()
        if data != "[DONE]":
            events.append(json.loads(data))
    return events


def test_cumulative_sse_keeps_prompt_logprobs_whole_and_output_logprobs_per_event() -> None:
    events = asyncio.run(_sse_events(incremental=False))
    metas = [e["meta_info"] for e in events]
    assert [e["output_ids"] for e in events][-1] == [21, 22, 23, 24]  # cumulative
    assert [len(m["input_token_logprobs"]) for m in metas] == [4, 4, 4, 4]
    assert [len(m["output_token_logprobs"]) for m in metas] == [1, 2, 0, 1]
    # SGLang's test_stream_logprobs: each chunk's entries are completion_tokens - previous
    prev = 0
    for m in metas:
        assert m["output_token_logprobs_length"] == m["completion_tokens"]
        assert len(m["output_token_logprobs"]) == m["completion_tokens"] - prev
        prev = m["completion_tokens"]


def test_incremental_sse_sends_deltas_everywhere() -> None:
    events = asyncio.run(_sse_events(incremental=True))
    assert [e["output_ids"] for e in events] == [[21], [22, 23], [], [24]]
    assert [len(e["meta_info"]["input_token_logprobs"]) for e in events] == [4, 0, 0, 0]


def test_client_merges_per_event_and_repeated_output_logprobs() -> None:
    per_event = [e["meta_info"] for e in asyncio.run(_sse_events(incremental=False))]
    total: dict[str, Any] = {}
    for meta in per_event:
        total = merge_stream_meta(total, meta)
    ids = [e[1] for e in total["output_token_logprobs"]]
    assert ids == [21, 22, 23, 24] and len(total["output_top_logprobs"]) == 4
    # a server that repeats all output logprobs in every event (length == count) is not doubled
    repeated: dict[str, Any] = {}
    for k in range(1, 5):
        event = {"output_token_logprobs": [[-1.0, t, None] for t in range(k)]}
        repeated = merge_stream_meta(repeated, {**event, "output_token_logprobs_length": k})
    assert [e[1] for e in repeated["output_token_logprobs"]] == [0, 1, 2, 3]


def test_ruled_out_tokens_have_null_logprobs() -> None:
    """A token a grammar masks has logprob -inf (asked for by token_ids_logprob, or a top-k
    wider than what the grammar allows): null in the JSON, as SGLang's orjson writes it."""
    state = _state(top=2)
    piece = _piece([21], 1, first=True, last=True)
    piece.token.output_top_logprobs = [[(-0.1, 21), (float("-inf"), 5)]]
    state.add(piece, 0.0)
    meta = build_output(None, state, final=True)["meta_info"]
    assert meta["output_top_logprobs"] == [[(-0.1, 21, None), (None, 5, None)]]
    json.dumps(meta, allow_nan=False)  # what the HTTP reply needs
