"""FakeBackend: a deterministic stand-in for a model, for exact tests of the interpreter.

Replies are scripted: `replies` maps a key text to a reply, and a request gets the reply of the
key that occurs latest in its prompt (ties: the first key given), else `default`. A reply may be
a list (sample j of an n-sample gen gets item j), or an exception instance (raised). "Tokens" are
words with their leading whitespace; a simulated radix cache reports `cached_tokens` as the
longest token prefix shared with any earlier prompt (or prompt + output), as the engine does.
Every request is recorded in `requests` so tests can check exactly what the DSL sent.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
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
from weft.lang.params import SamplingArgs
from weft.runtime.sampling_params import SamplingParams

Reply = str | Sequence[str] | BaseException
DEFAULT_SYSTEM = "You are a helpful assistant."
EOS = "<|im_end|>"
MATCH_LOGPROB, OTHER_LOGPROB, UNCOND_LOGPROB = -0.1, -2.0, -1.0
OUTPUT_LOGPROB = -0.5  # every generated token's logprob


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """A ChatML template with a default system prompt, like SmolLM2's."""
    msgs = list(messages)
    if msgs and msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": DEFAULT_SYSTEM})
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}{EOS}\n" for m in msgs)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def tokens(text: str) -> list[str]:
    """The fake tokenization: words with their leading whitespace (trailing space dropped)."""
    return re.findall(r"\s*\S+", text)


class FakeBackend(Backend):
    def __init__(
        self,
        replies: Mapping[str, Reply] | None = None,
        default: str = "ok",
        delay: float = 0.0,
    ) -> None:
        self.replies = dict(replies or {})
        self.default = default
        self.delay = delay  # seconds per request and per streamed piece, to observe asynchrony
        self.requests: list[GenRequest | SelectRequest | tuple[str, str]] = []
        self._template = ChatTemplate(chatml)
        self._cache: list[list[str]] = []
        self._lock = threading.Lock()

    ##### Backend #####

    def chat_template(self) -> ChatTemplate:
        return self._template

    def generate(self, req: GenRequest) -> list[Completion]:
        self._record(req)
        reply = self._reply(req.ctx.text)
        if isinstance(reply, BaseException):
            raise reply
        samples = [reply] if isinstance(reply, str) else list(reply)
        cached = self._cached(req.ctx.text)
        outs = []
        for j in range(req.args.n):
            text, finish = _apply(samples[j % len(samples)], req.args)
            self._remember(req.ctx.text + text)
            meta = self._meta(req.ctx.text, text, finish, cached, req.args)
            outs.append(Completion(text, meta))
        return outs

    def generate_stream(self, req: GenRequest) -> Iterator[StreamDelta]:
        """One token per delta, each with the meta so far (as a server's stream gives it)."""
        (out,) = self.generate(req)
        pieces = tokens(out.text) or [out.text]
        pieces[-1] += out.text[len("".join(pieces)) :]  # keep trailing whitespace
        for i, piece in enumerate(pieces):
            if i and self.delay:
                time.sleep(self.delay)
            last = i == len(pieces) - 1
            yield StreamDelta(piece, out.meta_info if last else _meta_so_far(out.meta_info, i + 1))

    def select(self, req: SelectRequest) -> ChoicesDecision:
        self._record(req)
        reply = self._reply(req.ctx.text)
        if isinstance(reply, BaseException):
            raise reply
        target = (reply if isinstance(reply, str) else reply[0]).strip()
        cond: list[list[LogprobEntry]] = []
        uncond: list[list[LogprobEntry]] = []
        for choice in req.choices:
            lp = MATCH_LOGPROB if target.startswith(choice.strip()) else OTHER_LOGPROB
            pieces = tokens(choice) or [choice]
            cond.append([(lp, _token_id(p), p) for p in pieces])
            uncond.append(
                [
                    (None if i == 0 else UNCOND_LOGPROB, _token_id(p), p)
                    for i, p in enumerate(pieces)
                ]
            )
        self._remember(req.ctx.text)
        decision = req.method(
            choices=list(req.choices),
            normalized_prompt_logprobs=[normalized_logprob(c) for c in cond],
            input_token_logprobs=cond,
            output_token_logprobs=[[] for _ in req.choices],
            unconditional_token_logprobs=uncond
            if req.method.requires_unconditional_logprobs
            else None,
        )
        decision.meta_info["prompt_tokens"] = len(tokens(req.ctx.text))
        return decision

    def cache_prefix(self, text: str, lora: str | None = None) -> None:
        self._record(("cache_prefix", text))
        self._remember(text)

    def flush_cache(self) -> bool:
        with self._lock:
            self._cache.clear()
        return True

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "fake", "replies": len(self.replies)}

    ##### Helpers #####

    @property
    def gen_requests(self) -> list[GenRequest]:
        return [r for r in self.requests if isinstance(r, GenRequest)]

    @property
    def prefixes_cached(self) -> list[str]:
        return [r[1] for r in self.requests if isinstance(r, tuple)]

    def _record(self, req: GenRequest | SelectRequest | tuple[str, str]) -> None:
        if self.delay:
            time.sleep(self.delay)
        with self._lock:
            self.requests.append(req)

    def _reply(self, prompt: str) -> Reply:
        best: tuple[int, Reply] | None = None
        for key, reply in self.replies.items():
            pos = prompt.rfind(key)
            if pos >= 0 and (best is None or pos + len(key) > best[0]):
                best = (pos + len(key), reply)
        return self.default if best is None else best[1]

    def _remember(self, text: str) -> None:
        with self._lock:
            self._cache.append(tokens(text))

    def _cached(self, prompt: str) -> int:
        toks = tokens(prompt)
        with self._lock:
            best = max((_common(toks, seen) for seen in self._cache), default=0)
        return min(best, max(len(toks) - 1, 0))  # the last prompt token is always recomputed

    def _meta(
        self, prompt: str, text: str, finish: dict[str, Any], cached: int, args: SamplingArgs
    ) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": f"fake-{len(self.requests)}",
            "finish_reason": finish,
            "prompt_tokens": len(tokens(prompt)),
            "completion_tokens": len(tokens(text)),
            "cached_tokens": cached,
        }
        if args.return_logprob:  # output logprobs only, as the default logprob_start_len gives
            with_text = args.return_text_in_logprobs
            out = [(OUTPUT_LOGPROB, _token_id(p), p if with_text else None) for p in tokens(text)]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = out
            meta["output_token_logprobs_length"] = len(out)
        return meta


def _apply(reply: str, args: SamplingArgs) -> tuple[str, dict[str, Any]]:
    """What a server returns for this reply: parameters checked as the runtime checks them
    (same ValueError), the grammar checked, then stops and max_new_tokens applied."""
    SamplingParams.from_dict(args.sampling_params())
    if args.regex is not None and not re.fullmatch(args.regex, reply):
        raise ValueError(
            f"fake backend: the reply {reply!r} does not match the regex {args.regex!r}"
        )
    if args.json_schema is not None:
        try:
            json.loads(reply)
        except ValueError as e:
            raise ValueError(f"fake backend: the reply {reply!r} is not JSON ({e})") from None
    finish: dict[str, Any] = {"type": "stop", "matched": EOS}
    cut = len(reply)
    for stop in args.stop:
        pos = reply.find(stop)
        if 0 <= pos < cut:
            cut, finish = pos, {"type": "stop", "matched": stop}
    for pattern in args.stop_regex:
        m = re.search(pattern, reply)
        if m is not None and m.start() < cut:
            cut, finish = m.start(), {"type": "stop", "matched": pattern}
    text = reply[:cut]
    limit = args.max_new_tokens
    if limit is not None and len(tokens(text)) > limit:
        text = "".join(tokens(text)[:limit])
        finish = {"type": "length", "length": limit}
    return text, finish


def _meta_so_far(meta: dict[str, Any], n: int) -> dict[str, Any]:
    """A finished gen's meta as it stood after its first n tokens (unfinished)."""
    out = {**meta, "finish_reason": None, "completion_tokens": n}
    if "output_token_logprobs" in meta:
        out["output_token_logprobs"] = meta["output_token_logprobs"][:n]
        out["output_token_logprobs_length"] = n
    return out


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 50000
