"""Backends that speak SGLang's native /generate protocol (in-process Engine, HTTP endpoint):
gen, streaming, select by prompt logprobs, and prefix warming, on five small primitives."""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from weft.lang.backends.base import (
    Backend,
    Completion,
    GenRequest,
    SelectRequest,
    StreamDelta,
)
from weft.lang.chat_template import ChatTemplate
from weft.lang.choices import ChoicesDecision, LogprobEntry, normalized_logprob

_OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
GREEDY_TEMPERATURE = 1e-5  # select scores deterministically: only greedy makes sense
_LIST_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


class NativeBackend(Backend):
    def __init__(self) -> None:
        self._template: ChatTemplate | None = None
        self._template_lock = threading.Lock()

    ##### Primitives #####

    @abstractmethod
    def _generate(self, payload: dict[str, Any]) -> Any:
        """A /generate request: a dict for one prompt with n == 1, else a list of dicts."""

    @abstractmethod
    def _generate_stream(self, payload: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """A streamed /generate request (n == 1): (new text, cumulative meta_info) pairs."""

    @abstractmethod
    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, as the server tokenizes a `text` prompt."""

    @abstractmethod
    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The chat template applied to messages, as text."""

    @abstractmethod
    def _auto_prefix(self) -> str:
        """Text the tokenizer puts in front of every prompt by itself (a BOS), or ""."""

    ##### Backend #####

    def chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._template is None:
                self._template = ChatTemplate(self._render_chat, self._auto_prefix())
            return self._template

    def generate(self, req: GenRequest) -> list[Completion]:
        out = self._generate(_payload(req))
        outs = out if isinstance(out, list) else [out]
        return [Completion(o["text"], o["meta_info"]) for o in outs]

    def generate_stream(self, req: GenRequest) -> Iterator[StreamDelta]:
        assert req.args.n == 1, "streamed gens have n == 1"
        for text, meta in self._generate_stream({**_payload(req), "stream": True}):
            yield StreamDelta(text, meta)

    def cache_prefix(self, text: str, lora: str | None = None) -> None:
        if text:
            self._generate(
                {"text": text, "sampling_params": {"max_new_tokens": 0}, **_lora_field(lora)}
            )

    def select(self, req: SelectRequest) -> ChoicesDecision:
        """Score each choice by the logprobs of exactly its tokens after the prompt.

        The prompt and every prompt+choice are tokenized; choice i's tokens start where its ids
        leave the prompt's (earlier than the prompt's end when the boundary merges: token
        healing). The prompt is prefilled once, then all choices go as one batch of prefill-only
        requests with input logprobs from that point, so each scores only its own tokens."""
        if req.temperature > GREEDY_TEMPERATURE:
            raise ValueError(
                f"select scores choices greedily: temperature must be 0, got {req.temperature}"
            )
        prefix = req.ctx.text
        choices = list(req.choices)
        ids = (
            self._tokenize([prefix, *(prefix + c for c in choices)])
            if prefix
            else [[], *self._tokenize(choices)]
        )
        prompt_ids, choice_ids = ids[0], ids[1:]
        starts = [_common_prefix(prompt_ids, c) for c in choice_ids]
        for choice, row, start in zip(choices, choice_ids, starts, strict=True):
            if start >= len(row):
                raise ValueError(f"select: choice {choice!r} adds no token to the prompt")
        lora = _lora_field(req.lora)
        if prompt_ids:
            self._generate(
                {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 0}, **lora}
            )
        scored = _as_list(self._generate({**_score_payload(choice_ids, starts), **lora}))
        cond: list[list[LogprobEntry]] = [_entries(o) for o in scored]
        uncond = None
        if req.method.requires_unconditional_logprobs:
            alone = [row[s:] for row, s in zip(choice_ids, starts, strict=True)]
            uncond = [
                _entries(o)
                for o in _as_list(
                    self._generate({**_score_payload(alone, [0] * len(alone)), **lora})
                )
            ]
        decision = req.method(
            choices=choices,
            normalized_prompt_logprobs=[normalized_logprob(e) for e in cond],
            input_token_logprobs=cond,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=uncond,
        )
        decision.meta_info["prompt_tokens"] = [o["meta_info"]["prompt_tokens"] for o in scored]
        decision.meta_info["cached_tokens"] = [o["meta_info"]["cached_tokens"] for o in scored]
        return decision


def _payload(req: GenRequest) -> dict[str, Any]:
    return {
        "text": req.ctx.text,
        "sampling_params": req.args.sampling_params(),
        **req.args.logprob_fields(),
        **_lora_field(req.args.lora),
    }


def _lora_field(lora: str | None) -> dict[str, Any]:
    """The request's `lora_path` (the adapter's name), only when one is asked for: a request
    without it runs on the base model on any server."""
    return {} if lora is None else {"lora_path": lora}


def _score_payload(rows: list[list[int]], starts: list[int]) -> dict[str, Any]:
    return {
        "input_ids": rows,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": starts,
        "return_text_in_logprobs": True,
    }


def _entries(out: dict[str, Any]) -> list[LogprobEntry]:
    return [(e[0], int(e[1]), e[2]) for e in out["meta_info"]["input_token_logprobs"]]


def _as_list(out: Any) -> list[dict[str, Any]]:
    return out if isinstance(out, list) else [out]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def merge_stream_meta(total: dict[str, Any], event_meta: dict[str, Any]) -> dict[str, Any]:
    """The meta so far of a /generate stream, from its latest event. The prompt's lists come
    whole in every event; the output's lists hold the event's own tokens (weft, and the
    convention SGLang's frontend reads), or all tokens so far when their length is already
    output_token_logprobs_length (a server that repeats them)."""
    merged = dict(event_meta)
    new = event_meta.get("output_token_logprobs")
    if new is None or len(new) == event_meta.get("output_token_logprobs_length"):
        return merged
    for key in _OUTPUT_KEYS:
        if key in event_meta:
            merged[key] = list(total.get(key, [])) + list(event_meta[key])
    return merged


def accumulate_meta(total: dict[str, Any], delta_meta: dict[str, Any]) -> dict[str, Any]:
    """Merge a stream delta's meta_info (per-delta logprob lists) into the running total."""
    merged = dict(delta_meta)
    for key in _LIST_KEYS:
        if key in delta_meta:
            merged[key] = list(total.get(key, [])) + list(delta_meta[key])
    return merged
