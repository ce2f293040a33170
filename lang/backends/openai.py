"""OpenAI: programs on any OpenAI-compatible server (/v1/chat/completions or /v1/completions)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from weft.lang.backends.base import (
    Backend,
    BackendError,
    Completion,
    Context,
    GenRequest,
    SelectRequest,
    StreamDelta,
)
from weft.lang.backends.runtime_endpoint import _message
from weft.lang.chat_template import ChatTemplate, plain_template
from weft.lang.choices import ChoicesDecision, LogprobEntry, normalized_logprob
from weft.lang.params import SamplingArgs


class OpenAI(Backend):
    """`OpenAI(model, base_url="https://api.openai.com/v1", api_key=None, is_chat_model=True)`.

    Chat models get the program's messages, so a gen (or select) must come right at the start of
    an assistant turn. Completion models get the program text. select: a completion model scores
    the choices by their echoed prompt logprobs; a chat model cannot, so the choice is made by
    the server under a JSON schema whose only values are the choices (structured outputs)."""

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        is_chat_model: bool = True,
        timeout: float = 600.0,
        transport: Any = None,  # an httpx transport (tests use httpx.MockTransport)
    ) -> None:
        import httpx

        if model.startswith(("http://", "https://")):
            raise ValueError(
                f"OpenAI(model, base_url=...): the first argument is the model name, got the URL "
                f"{model!r}; write OpenAI({'model-name'!r}, base_url={model!r})"
            )
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.is_chat_model = is_chat_model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.Client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            transport=transport,
        )
        self._template = plain_template()

    ##### Backend #####

    def chat_template(self) -> ChatTemplate:
        return self._template

    def generate(self, req: GenRequest) -> list[Completion]:
        path, body = self._body(req.ctx, req.args)
        out = self._post(path, body)
        usage = out.get("usage") or {}
        return [
            Completion(_choice_text(c), _meta(out.get("id"), c, usage, len(out["choices"])))
            for c in sorted(out["choices"], key=lambda c: c["index"])
        ]

    def generate_stream(self, req: GenRequest) -> Iterator[StreamDelta]:
        import httpx

        path, body = self._body(req.ctx, req.args)
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        meta: dict[str, Any] = {}
        try:
            with self._client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise BackendError(
                        f"POST {path}: HTTP {resp.status_code}: {_message(resp.text)}"
                    )
                for line in resp.iter_lines():
                    data = line[len("data:") :].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(f"POST {path} (stream): {_message(data)}")
                    for c in chunk.get("choices", []):
                        if c.get("finish_reason"):
                            meta = _meta(chunk.get("id"), c, {}, 1)
                        text = _choice_text(c, delta=True)
                        if text:
                            yield StreamDelta(text)
                    if chunk.get("usage"):
                        meta = {**meta, **_usage_meta(chunk["usage"], 1)}
        except httpx.HTTPError as e:
            raise BackendError(f"POST {self.base_url}{path} failed: {e}") from e
        yield StreamDelta("", meta)

    def select(self, req: SelectRequest) -> ChoicesDecision:
        if self.is_chat_model:
            return self._select_constrained(req)
        prompts = [req.ctx.text + c for c in req.choices]
        body = {
            "model": self._model(req.lora),
            "prompt": prompts,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 0,
            "temperature": 0,
        }
        out = self._post("/completions", body)
        rows = sorted(out["choices"], key=lambda c: c["index"])
        cond = [
            _choice_logprobs(row["logprobs"], len(req.ctx.text), len(p))
            for row, p in zip(rows, prompts, strict=True)
        ]
        if req.method.requires_unconditional_logprobs:
            raise ValueError(
                "unconditional_likelihood_normalized is not supported by the OpenAI backend"
            )
        return req.method(
            choices=list(req.choices),
            normalized_prompt_logprobs=[normalized_logprob(c) for c in cond],
            input_token_logprobs=cond,
            output_token_logprobs=[[] for _ in req.choices],
        )

    def cache_prefix(self, text: str, lora: str | None = None) -> None:
        """Nothing to do: OpenAI-compatible servers cache prompt prefixes on their own."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, **self._get("/models")}

    def shutdown(self) -> None:
        self._client.close()

    ##### Internals #####

    def _select_constrained(self, req: SelectRequest) -> ChoicesDecision:
        schema = {
            "type": "object",
            "properties": {"choice": {"type": "string", "enum": list(req.choices)}},
            "required": ["choice"],
            "additionalProperties": False,
        }
        args = SamplingArgs(max_new_tokens=None, temperature=0.0, lora=req.lora)
        _, body = self._body(req.ctx, args)
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "choice", "schema": schema, "strict": True},
        }
        text = _choice_text(self._post("/chat/completions", body)["choices"][0])
        try:
            decision = json.loads(text)["choice"]
        except (ValueError, KeyError, TypeError):
            decision = None
        if decision not in req.choices:
            raise BackendError(
                f"select: the server answered {text!r}, which names none of the choices "
                f"{list(req.choices)}"
            )
        return ChoicesDecision(
            str(decision), {"method": "constrained (json_schema enum)", "response": text}
        )

    def _body(self, ctx: Context, args: SamplingArgs) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._model(args.lora),
            "temperature": args.temperature,
            "top_p": args.top_p,
            "n": args.n,
        }
        if args.max_new_tokens is not None:
            body["max_tokens"] = args.max_new_tokens
        if args.stop:
            body["stop"] = list(args.stop)
        for key in ("frequency_penalty", "presence_penalty"):
            if getattr(args, key):
                body[key] = getattr(args, key)
        for key, default in (("top_k", -1), ("min_p", 0.0), ("ignore_eos", False), ("regex", None)):
            if getattr(args, key) != default:  # SGLang/weft extensions: only when asked for
                body[key] = getattr(args, key)
        if args.min_new_tokens:
            body["min_tokens"] = args.min_new_tokens
        if args.stop_token_ids:
            body["stop_token_ids"] = list(args.stop_token_ids)
        if args.stop_regex:
            body["stop_regex"] = list(args.stop_regex)
        if args.json_schema is not None:
            schema = json.loads(args.json_schema)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        if not self.is_chat_model:
            if args.return_logprob:
                body["logprobs"] = args.top_logprobs_num or 0
            return "/completions", {**body, "prompt": ctx.text}
        if ctx.role != "assistant" or ctx.turn_text:
            raise ValueError(
                "the OpenAI backend with a chat model generates whole assistant messages: put "
                "gen()/select() right at the start of an assistant turn, e.g. "
                "s += assistant(gen('answer'))"
            )
        if args.return_logprob:
            body["logprobs"] = True
            if args.top_logprobs_num:
                body["top_logprobs"] = args.top_logprobs_num
        return "/chat/completions", {**body, "messages": list(ctx.messages)}

    def _model(self, lora: str | None) -> str:
        """The request's model: a LoRA adapter is named as "base:adapter" (SGLang, weft)."""
        return self.model if lora is None else f"{self.model}:{lora}"

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", path, body)

    def _get(self, path: str) -> dict[str, Any]:
        return self._call("GET", path, None)

    def _call(self, method: str, path: str, body: Any) -> dict[str, Any]:
        import httpx

        try:
            resp = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e}") from e
        if resp.status_code != 200:
            raise BackendError(f"{method} {path}: HTTP {resp.status_code}: {_message(resp.text)}")
        data: dict[str, Any] = resp.json()
        return data


def _choice_text(choice: dict[str, Any], delta: bool = False) -> str:
    if "text" in choice:
        return str(choice["text"] or "")
    message = choice.get("delta" if delta else "message") or {}
    return str(message.get("content") or "")


def _usage_meta(usage: dict[str, Any], n: int) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0) // max(n, 1),
        "cached_tokens": details.get("cached_tokens", 0),
    }


def _meta(rid: Any, choice: dict[str, Any], usage: dict[str, Any], n: int) -> dict[str, Any]:
    reason = choice.get("finish_reason")
    finish = None if reason is None else {"type": reason, "matched": choice.get("matched_stop")}
    meta = {"id": rid, "finish_reason": finish, **_usage_meta(usage, n)}
    if choice.get("logprobs") is not None:
        meta["logprobs"] = choice["logprobs"]
    return meta


def _choice_logprobs(lp: dict[str, Any] | None, start: int, end: int) -> list[LogprobEntry]:
    """The echoed prompt tokens that overlap [start, end): the choice's own tokens."""
    if lp is None:
        raise BackendError("select: the server returned no logprobs for the echoed prompt")
    out: list[LogprobEntry] = []
    for token, value, offset in zip(
        lp["tokens"], lp["token_logprobs"], lp["text_offset"], strict=True
    ):
        if offset < end and offset + len(token) > start:
            out.append((value, -1, token))
    if not out:
        raise BackendError(
            "select: no echoed token covers the choice (does the server support echo?)"
        )
    return out
