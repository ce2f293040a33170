"""OpenAI API results: finish reason, usage and logprobs (the legacy and the chat shape) in OpenAI
terms, from SGLang-shaped results."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from weft.runtime.loader.synthetic_tokenizer import byte_alphabet


def finish_of(meta: Mapping[str, Any]) -> tuple[str | None, int | str | None]:
    """(finish_reason, matched_stop) in OpenAI terms from SGLang's meta_info."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    kind = str(reason["type"])
    return kind, reason.get("matched") if kind == "stop" else None


def schema_fields(meta: Mapping[str, Any], finished: bool = True) -> dict[str, Any]:
    """weft's fields on a finished choice of a JSON-schema request (clients may ignore them):
    `schema_valid` (the output validated against the full schema; null: it could not be
    checked) and, unless true, `schema_error` {path, keyword_path, message}."""
    if not finished or "schema_valid" not in meta:
        return {}
    out = {"schema_valid": meta["schema_valid"]}
    if "schema_error" in meta:
        out["schema_error"] = meta["schema_error"]
    return out


def usage_of(
    metas: Mapping[int, Mapping[str, Any]], n: int, report_cached: bool, force_cached: bool = False
) -> dict[str, Any]:
    """metas by choice index (prompt-major, n per prompt): each prompt is counted once (its first
    sample), completion tokens are summed over every choice."""
    firsts = [m for i, m in metas.items() if i % n == 0]
    prompt = sum(int(m.get("prompt_tokens", 0)) for m in firsts)
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas.values())
    cached = sum(int(m.get("cached_tokens", 0)) for m in firsts)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "reasoning_tokens": 0,
    }
    if force_cached or (report_cached and cached > 0):
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def logprob_rows(meta: Mapping[str, Any], echo: bool) -> tuple[list[Any], list[Any]]:
    """(entries, top entries per position): the prompt's first when echo, then the output's."""
    entries: list[Any] = []
    tops: list[Any] = []
    for side in ("input", "output") if echo else ("output",):
        rows = list(meta.get(f"{side}_token_logprobs") or [])
        top = list(meta.get(f"{side}_top_logprobs") or [])
        entries += rows
        tops += top + [[]] * (len(rows) - len(top))
    return entries, tops


def _lp(value: float) -> float:
    """JSON has no -inf: clip like vLLM does."""
    return max(value, -9999.0) if math.isfinite(value) else -9999.0


def legacy_logprobs(
    entries: Sequence[Sequence[Any]], tops: Sequence[Sequence[Sequence[Any]]], offset: int
) -> dict[str, Any]:
    """/v1/completions logprobs: {tokens, token_logprobs, top_logprobs, text_offset}.

    entries are SGLang's (logprob | None, id, text); the first prompt token's logprob is None and
    so is its top_logprobs. The chosen token is always in its position's top dict (k+1 entries)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for i, (lp, _, text) in enumerate(entries):
        token = text or ""
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(lp))
        top = {str(t[2] or ""): _lp(t[0]) for t in (tops[i] if i < len(tops) else [])}
        top.setdefault(token, _lp(lp))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(
    tokenizer: Any, entries: Sequence[Sequence[Any]], tops: Sequence[Sequence[Sequence[Any]]]
) -> dict[str, Any]:
    """/v1/chat/completions logprobs: {content: [{token, bytes, logprob, top_logprobs}]}."""
    content = []
    for i, (lp, token_id, text) in enumerate(entries):
        top = tops[i] if i < len(tops) else []
        content.append(
            {
                **_chat_token(tokenizer, token_id, text, lp),
                "top_logprobs": [_chat_token(tokenizer, t[1], t[2], t[0]) for t in top],
            }
        )
    return {"content": content}


def _chat_token(tokenizer: Any, token_id: int, text: str | None, lp: float) -> dict[str, Any]:
    token = text or ""
    return {"token": token, "bytes": token_bytes(tokenizer, token_id, token), "logprob": _lp(lp)}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The token's own UTF-8 bytes: for byte-level BPE these may be part of a character (OpenAI's
    reason for the field); otherwise the bytes of its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    table = _byte_level_decoder()
    if isinstance(piece, str) and piece and all(ch in table for ch in piece):
        raw = bytes(table[ch] for ch in piece)
        if raw.decode("utf-8", errors="replace") == text:
            return list(raw)
    return list(text.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE token text back to its bytes (GPT-2's alphabet, inverted)."""
    return {ch: b for b, ch in byte_alphabet().items()}
