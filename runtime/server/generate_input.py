"""GenerateInput: a /generate-shaped request (single or batch), checked and split into one spec per prompt."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weft.runtime.sampling_params import SamplingParams
from weft.runtime.text_checks import check_text


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of a request, before tokenization and the n-fold fan-out."""

    index: int
    rid: str
    text: str | None
    input_ids: list[int] | None
    params: SamplingParams
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int]
    return_text_in_logprobs: bool
    stream: bool
    lora_path: str | None = None  # the LoRA adapter's name; None: the base model

    def needs_tokenizer(self) -> str | None:
        """The first thing this prompt asks for that only a tokenizer gives, or None."""
        p = self.params
        if self.text is not None:
            return "a text prompt"
        if p.stop:
            return "stop strings (stop)"
        if p.stop_regex:
            return "stop_regex"
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(p, name) is not None:
                return f"constrained decoding ({name})"
        if self.return_logprob and self.return_text_in_logprobs:
            return "return_text_in_logprobs"
        return None


def no_tokenizer(what: str) -> ValueError:
    """The refusal of `what` on a runtime started with skip_tokenizer_init."""
    return ValueError(
        f"{what} needs a tokenizer, but this runtime runs with skip_tokenizer_init (token ids in, "
        "token ids out): send input_ids (on /v1/completions a prompt of token ids) and read "
        "output_ids"
    )


@dataclass(frozen=True)
class GenerateInput:
    """The fields of SGLang's GenerateReqInput that weft serves (sglang-api.md b.1)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # an adapter's name, or one per prompt
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_batch(self) -> bool:
        return isinstance(self.text, list) or (
            isinstance(self.input_ids, list)
            and bool(self.input_ids)
            and isinstance(self.input_ids[0], list)
        )

    def specs(self) -> list[PromptSpec]:
        """One PromptSpec per prompt; raises ValueError naming the offending field."""
        if self.extra:
            raise ValueError(f"unknown field(s): {', '.join(sorted(self.extra))}")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("Either text or input_ids should be provided (exactly one of them).")
        texts, ids = _prompts(self.text, self.input_ids)
        n = len(texts) if texts is not None else len(ids or [])
        if n == 0:
            raise ValueError("the batch is empty: give at least one prompt")
        batch = self.is_batch
        params = _per_prompt(self.sampling_params, n, "sampling_params", batch)
        rids = _per_prompt(self.rid, n, "rid", batch)
        lp = _per_prompt(self.return_logprob, n, "return_logprob", batch)
        start = _per_prompt(self.logprob_start_len, n, "logprob_start_len", batch)
        top = _per_prompt(self.top_logprobs_num, n, "top_logprobs_num", batch)
        loras = _per_prompt(self.lora_path, n, "lora_path", batch)
        specs = []
        for i in range(n):
            sp = SamplingParams.from_dict(params[i])
            rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"rid must be a non-empty string, got {rid!r}")
            check_text(rid, "rid")
            specs.append(
                PromptSpec(
                    index=i,
                    rid=rid,
                    text=texts[i] if texts is not None else None,
                    input_ids=ids[i] if ids is not None else None,
                    params=sp,
                    return_logprob=_bool(lp[i], "return_logprob"),
                    logprob_start_len=_int(start[i], "logprob_start_len", -1),
                    top_logprobs_num=_int(top[i], "top_logprobs_num", 0),
                    token_ids_logprob=_id_list(self.token_ids_logprob, "token_ids_logprob"),
                    return_text_in_logprobs=_bool(
                        self.return_text_in_logprobs, "return_text_in_logprobs"
                    ),
                    stream=_bool(self.stream, "stream"),
                    lora_path=_lora_name(loras[i]),
                )
            )
        seen = [s.rid for s in specs]
        if len(set(seen)) != len(seen):
            raise ValueError("rid values in a batch must be unique")
        return specs


def _prompts(text: Any, input_ids: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    if text is not None:
        items = text if isinstance(text, list) else [text]
        for t in items:
            if not isinstance(t, str):
                raise ValueError(
                    f"text must be a string or a list of strings, got {type(t).__name__}"
                )
            if not t:
                raise ValueError("text must not be empty")
            check_text(t, "text")
        return items, None
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError(
            "input_ids must be a non-empty list of token ids (or a list of such lists)"
        )
    rows = input_ids if isinstance(input_ids[0], list) else [input_ids]
    return None, [_id_list(r, "input_ids", nonempty=True) for r in rows]


def _per_prompt(value: Any, n: int, name: str, batch: bool) -> list[Any]:
    """A scalar applies to every prompt; a list gives one value per prompt of a batch."""
    if isinstance(value, list):
        if not batch:
            raise ValueError(f"{name} is a list but the prompt is not a batch")
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but the batch has {n} prompts")
        return list(value)
    return [value] * n


def _id_list(value: Any, name: str, nonempty: bool = False) -> list[int]:
    if value is None:
        return []
    # NOTE: the type set first (one C-level pass: a batch of 1,024 x 2k-token prompts took
    # 0.4 s element by element); int subclasses other than bool take the slow check
    if not isinstance(value, list) or not (
        set(map(type, value)) <= {int}
        or all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise ValueError(f"{name} must be a list of integer token ids")
    if nonempty and not value:
        raise ValueError(f"{name} must not be empty")
    if value and min(value) < 0:
        raise ValueError(f"{name} must not contain negative token ids")
    return list(value)


def _lora_name(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"lora_path must be a LoRA adapter's name (a non-empty string) or null, "
                         f"got {value!r}")  # fmt: skip
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _int(value: Any, name: str, minimum: int) -> int:
    if value is None:
        return minimum
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value
