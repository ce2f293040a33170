"""OpenAI-compatible API: /v1/models, /v1/completions (SSE included), and what the /v1 routes share
(model checks, stream options, usage, waiting for results)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from weft.runtime.server.http.openai_results import (
    finish_of,
    legacy_logprobs,
    logprob_rows,
    schema_fields,
    usage_of,
)
from weft.runtime.server.http.responses import held_stream, openai_stream, unenforced_headers
from weft.runtime.server.http.state import (
    AppState,
    read_json,
    state_of,
    until_done_or_disconnect,
)
from weft.runtime.server.output import ReqState
from weft.runtime.server.tokenizer_manager import TokenizerManager

router = APIRouter()

R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


##### Models #####


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The base model, then each LoRA adapter served (its `parent` is the base model, as vLLM's)."""
    state = state_of(request)
    adapters = state.manager.lora_adapters
    return {
        "object": "list",
        "data": [_model_card(state), *(_model_card(state, n) for n in adapters)],
    }


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    state = state_of(request)
    if model_id == state.config.model_name:
        return JSONResponse(_model_card(state))
    if model_id in state.manager.lora_adapters:
        return JSONResponse(_model_card(state, model_id))
    raise _model_not_found(model_id)


def _model_card(state: AppState, adapter: str | None = None) -> dict[str, Any]:
    base = state.config.model_name
    card = {
        "id": base,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "weft",
        "root": base,
        "parent": None,
        "max_model_len": state.rt.info.context_len,
    }
    if adapter is not None:
        root = state.manager.lora_adapters.get(adapter, adapter)
        card.update(id=adapter, root=root, parent=base)
    return card


def _model_not_found(name: str, why: str = "") -> BadRequest:
    message = f"The model '{name}' does not exist{why}"
    return BadRequest(message, 404, "model", code="model_not_found")


def lora_of(state: AppState, req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The LoRA adapter a /v1 request runs: named by `model` ("base:adapter" or the adapter's own
    name, as SGLang and vLLM take it) or by SGLang's `lora_path`; None: the base model. A model
    this server does not serve is a 404."""
    base, adapters = state.config.model_name, state.manager.lora_adapters
    served = ", ".join(adapters) or "none"
    if req.model in (base, "default"):
        adapter = None
    elif req.model.startswith(f"{base}:"):
        adapter = req.model[len(base) + 1 :]
        if adapter not in adapters:
            why = f": no LoRA adapter {adapter!r} is loaded (loaded: {served})"
            raise _model_not_found(req.model, why)
    elif req.model in adapters:
        adapter = req.model
    else:
        raise _model_not_found(req.model)
    if req.lora_path is not None and adapter is not None and req.lora_path != adapter:
        raise BadRequest(f"model {req.model!r} and lora_path {req.lora_path!r} name different "
                         "LoRA adapters", 400, "lora_path")  # fmt: skip
    return adapter if adapter is not None else req.lora_path


##### /v1/completions #####


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state, req, lora = await v1_request(request, CompletionRequest)
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise BadRequest("best_of is not supported (only best_of == n)", 400, "best_of")
    if req.echo:
        state.tokenizer_for("echo (the prompt as text)")
    if req.logprobs is not None:
        state.tokenizer_for("logprobs on /v1/completions (tokens as text)")
    prompts = _prompts(req.prompt)
    rid = req.rid if isinstance(req.rid, str) else f"cmpl-{uuid.uuid4().hex}"
    rids: str | list[str] = (
        rid if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    )
    if isinstance(req.rid, list):
        rids = req.rid
    single: Any = prompts[0] if len(prompts) == 1 else prompts
    by_text = isinstance(prompts[0], str)
    obj = GenerateInput(
        text=single if by_text else None,
        input_ids=None if by_text else single,
        sampling_params=req.sampling_params(req.max_tokens, {}),
        rid=rids,
        return_logprob=req.logprobs is not None,
        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
        top_logprobs_num=req.logprobs or 0,
        return_text_in_logprobs=True,
        stream=req.stream,
        lora_path=lora,
    )
    manager = state.manager
    states = await manager.submit(obj)
    echoes = [await _prompt_text(state, p) for p in prompts] if req.echo else []
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model}
    if req.stream:
        results, headers = await held_stream(request, manager, states)
        chunks = _completion_chunks(state, req, results, head, echoes)
        return openai_stream(chunks, headers, "/v1/completions")
    outs = await collect(request, manager, states)
    choices, metas = [], {}
    for k, out in enumerate(outs):
        meta = metas[k] = out["meta_info"]
        reason, matched = finish_of(meta)
        logprobs = None
        if req.logprobs is not None:
            logprobs = legacy_logprobs(*logprob_rows(meta, req.echo), offset=0)
        text = (echoes[k // req.n] if req.echo else "") + out.get("text", "")
        choice = _choice(k, text, logprobs, reason, matched, _ids_without_text(out))
        choices.append({**choice, **schema_fields(meta)})
    body = {**head, "choices": choices, "usage": usage(state, req, metas)}
    return JSONResponse(body, headers=unenforced_headers(metas.values()))


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """One entry per prompt: a string or a list of token ids."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if items and isinstance(items[0], int):
        items = [items]
    if not items or any(len(p) == 0 for p in items):
        raise BadRequest("Prompt cannot be empty", 400, "prompt")
    return items


async def _prompt_text(state: AppState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    decode = state.rt.tokenizer.decode
    return str(await state.manager.run_blocking(decode, prompt, skip_special_tokens=False))


async def _completion_chunks(
    state: AppState,
    req: CompletionRequest,
    results: AsyncGenerator[dict[str, Any], None],
    head: dict[str, Any],
    echoes: list[str],
) -> AsyncGenerator[dict[str, Any], None]:
    """OpenAI's completion stream: text deltas; finish_reason rides on each index's last chunk."""
    metas: dict[int, dict[str, Any]] = {}
    sent: dict[int, int] = {}  # characters sent per index (the next text_offset)
    async with aclosing(results):
        async for delta in results:
            k = int(delta.get("index", 0))
            meta = metas[k] = delta["meta_info"]
            text = delta.get("text", "")
            if req.echo and k not in sent:
                text = echoes[k // req.n] + text
            logprobs = None
            if req.logprobs is not None:
                logprobs = legacy_logprobs(*logprob_rows(meta, req.echo), offset=sent.get(k, 0))
            sent[k] = sent.get(k, 0) + len(text)
            reason, matched = finish_of(meta)
            ids = _ids_without_text(delta)
            if not text and not ids and reason is None and not (logprobs and logprobs["tokens"]):
                continue
            choice = _choice(k, text, logprobs, reason, matched, ids)
            chunk = {**head, "choices": [{**choice, **schema_fields(meta, reason is not None)}]}
            yield with_usage(chunk, state, req, metas, continuous=True)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield with_usage({**head, "choices": []}, state, req, metas, continuous=False)


def _choice(
    k: int,
    text: str,
    logprobs: Any,
    reason: str | None,
    matched: int | str | None,
    output_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One choice; with skip_tokenizer_init the text is empty and `output_ids` (a weft field, as on
    /generate) carries the tokens."""
    choice = {"index": k, "text": text}
    if output_ids is not None:
        choice["output_ids"] = output_ids
    return {**choice, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}


def _ids_without_text(out: dict[str, Any]) -> list[int] | None:
    """A result's output ids when it has no text (skip_tokenizer_init), else None."""
    return None if "text" in out else list(out["output_ids"])


##### Shared #####


async def v1_request(request: Request, cls: type[R]) -> tuple[AppState, R, str | None]:
    """The route's state, its /v1 body as `cls` and the LoRA adapter it runs (lora_of), for a
    model this server serves (else a 404), with stream_options only where stream is true."""
    state = state_of(request)
    req = parse_request(cls, await read_json(request, strict=True))
    lora = lora_of(state, req)
    if req.stream_options is not None and not req.stream:
        raise BadRequest(
            "stream_options is only allowed when stream is true", 400, "stream_options"
        )
    _check_limits(state, req)
    return state, req, lora


def _check_limits(state: AppState, req: CompletionRequest | ChatCompletionRequest) -> None:
    """n and the top logprobs against the server's caps (--max-n, --max-top-logprobs): a 400
    naming the OpenAI field."""
    limits = state.config.limits
    name = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
    top = getattr(req, name)
    try:
        limits.check_n(req.n)
    except ValueError as e:
        raise BadRequest(str(e), 400, "n") from None
    try:
        if top is not None:
            limits.check_top_logprobs(top, name)
    except ValueError as e:
        raise BadRequest(str(e), 400, name) from None


def usage(
    state: AppState,
    req: CompletionRequest | ChatCompletionRequest,
    metas: Mapping[int, Mapping[str, Any]],
) -> dict[str, Any]:
    force = isinstance(req, ChatCompletionRequest) and req.return_cached_tokens_details
    return usage_of(metas, req.n, state.config.enable_cache_report, force)


def with_usage(
    chunk: dict[str, Any],
    state: AppState,
    req: CompletionRequest | ChatCompletionRequest,
    metas: Mapping[int, Mapping[str, Any]],
    continuous: bool,
) -> dict[str, Any]:
    """The usage chunk (continuous=False), or any chunk with continuous_usage_stats."""
    options = req.stream_options
    if continuous and (options is None or not options.continuous_usage_stats):
        return chunk
    return {**chunk, "usage": usage(state, req, metas)}


async def collect(
    request: Request, manager: TokenizerManager, states: list[ReqState]
) -> list[dict[str, Any]]:
    def abort_all() -> None:
        for s in states:
            manager.abort(s.rid)

    outs: list[dict[str, Any]] = await until_done_or_disconnect(
        request, manager.collect(states), abort_all
    )
    return outs
