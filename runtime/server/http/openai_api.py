"""OpenAI-compatible API: /v1/models, /v1/completions and /v1/chat/completions (SSE included)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from weft.runtime.server.chat import normalize_messages, render_chat
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http.app import AppState, BadRequest, read_json, until_done_or_disconnect
from weft.runtime.server.http.native import state_of
from weft.runtime.server.http.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    finish_of,
    legacy_logprobs,
    logprob_rows,
    parse_request,
    usage_of,
)
from weft.runtime.server.http.responses import held_stream, openai_stream, unenforced_headers
from weft.runtime.server.http.tool_calls import (
    ToolPlan,
    finish_reason,
    markers_are_special,
    resolve_tool_format,
    split_output,
    stream_deltas,
)
from weft.runtime.server.http.tool_parser import ToolCallParser, ToolFormat
from weft.runtime.server.tokenizer_manager import ReqState, TokenizerManager

router = APIRouter()

_CHAT_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


##### Models #####


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    state = state_of(request)
    if model_id != state.config.model_name:
        return _model_not_found(model_id)
    return JSONResponse(_model_card(state))


def _model_card(state: AppState) -> dict[str, Any]:
    name = state.config.model_name
    return {
        "id": name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "weft",
        "root": name,
        "parent": None,
        "max_model_len": state.rt.info.context_len,
    }


def _model_not_found(name: str) -> JSONResponse:
    err = {
        "message": f"The model '{name}' does not exist",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    return JSONResponse({"error": err}, status_code=404)


def _known_model(state: AppState, name: str) -> bool:
    return name in (state.config.model_name, "default")


##### /v1/completions #####


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = state_of(request)
    req = parse_request(CompletionRequest, await read_json(request, strict=True))
    if not _known_model(state, req.model):
        return _model_not_found(req.model)
    _check_stream_options(req.stream, req.stream_options is not None)
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise BadRequest("best_of is not supported (only best_of == n)", 400, "best_of")
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
    )
    manager = state.manager
    states = await manager.submit(obj)
    echoes = [_prompt_text(state, p) for p in prompts] if req.echo else []
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model}
    if req.stream:
        results, headers = await held_stream(request, manager, states)
        chunks = _completion_chunks(state, req, results, head, echoes)
        return openai_stream(chunks, headers)
    outs = await _collect(request, manager, states)
    choices, metas = [], {}
    for k, out in enumerate(outs):
        meta = metas[k] = out["meta_info"]
        reason, matched = finish_of(meta)
        logprobs = None
        if req.logprobs is not None:
            logprobs = legacy_logprobs(*logprob_rows(meta, req.echo), offset=0)
        text = (echoes[k // req.n] if req.echo else "") + out["text"]
        choices.append(_choice(k, text=text, logprobs=logprobs, reason=reason, matched=matched))
    body = {**head, "choices": choices, "usage": _usage(state, req, metas)}
    return JSONResponse(body, headers=unenforced_headers(metas.values()))


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """One entry per prompt: a string or a list of token ids."""
    items: list[Any] = [prompt] if isinstance(prompt, str) else list(prompt)
    if items and isinstance(items[0], int):
        items = [items]
    if not items or any(len(p) == 0 for p in items):
        raise BadRequest("Prompt cannot be empty", 400, "prompt")
    return items


def _prompt_text(state: AppState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    return str(state.rt.tokenizer.decode(prompt, skip_special_tokens=False))


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
            text = delta["text"]
            if req.echo and k not in sent:
                text = echoes[k // req.n] + text
            logprobs = None
            if req.logprobs is not None:
                logprobs = legacy_logprobs(*logprob_rows(meta, req.echo), offset=sent.get(k, 0))
            sent[k] = sent.get(k, 0) + len(text)
            reason, matched = finish_of(meta)
            if not text and reason is None and not (logprobs and logprobs["tokens"]):
                continue
            chunk = {**head, "choices": [_choice(k, text, logprobs, reason, matched)]}
            yield _with_usage(chunk, state, req, metas, continuous=True)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield _with_usage({**head, "choices": []}, state, req, metas, continuous=False)


def _choice(
    k: int, text: str, logprobs: Any, reason: str | None, matched: int | str | None
) -> dict[str, Any]:
    return {
        "index": k,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": matched,
    }


##### /v1/chat/completions #####


def _tool_format(state: AppState) -> tuple[ToolFormat, bool]:
    """The server's tool-call format (--tool-call-parser, or the chat template's) and whether
    its markers are special tokens of the tokenizer: worked out once."""
    if state.tool_format is None:
        tokenizer = state.rt.tokenizer
        template = state.chat_template or getattr(tokenizer, "chat_template", None)
        fmt = resolve_tool_format(state.config.tool_call_parser, template)
        state.tool_format = (fmt, markers_are_special(tokenizer))
    return state.tool_format


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = state_of(request)
    req = parse_request(ChatCompletionRequest, await read_json(request, strict=True))
    if not _known_model(state, req.model):
        return _model_not_found(req.model)
    _check_stream_options(req.stream, req.stream_options is not None)
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs to be true", 400, "top_logprobs")
    rt = state.rt
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is not None and max_new > rt.info.context_len:
        raise BadRequest(
            f"max_completion_tokens is too large: {max_new} > the context length "
            f"{rt.info.context_len}",
            400,
            "max_completion_tokens",
        )
    messages = normalize_messages(req.messages)
    tool_format, markers_special = _tool_format(state)
    plan = req.tool_plan(tool_format)
    prompt = render_chat(
        rt.tokenizer,
        messages,
        state.chat_template,
        tools=plan.tools,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
    )
    params = req.sampling_params(max_new, _generation_defaults(str(rt.model_path)))
    if plan.mode != "none" and req.skip_special_tokens is None and markers_special:
        params["skip_special_tokens"] = False
    constraint = plan.constraint()
    if constraint:
        if any(k in params for k in ("json_schema", "regex", "ebnf", "structural_tag")):
            why = "strict functions" if plan.mode == "auto" else f"tool_choice {plan.mode}"
            raise BadRequest(
                f"the output's tool calls are constrained ({why}): this cannot be combined "
                "with response_format, json_schema, regex, ebnf or structural_tag",
                400,
                "tool_choice",
            )
        params.update(constraint)
    rid = req.rid if isinstance(req.rid, str) else f"chatcmpl-{uuid.uuid4().hex}"
    obj = GenerateInput(
        input_ids=prompt,
        sampling_params=params,
        rid=rid,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        return_text_in_logprobs=True,
        stream=req.stream,
    )
    manager = state.manager
    states = await manager.submit(obj)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model}
    if req.stream:
        head["object"] = "chat.completion.chunk"
        results, headers = await held_stream(request, manager, states)
        return openai_stream(_chat_chunks(state, req, plan, results, head), headers)
    outs = await _collect(request, manager, states)
    choices, metas = [], {}
    for k, out in enumerate(outs):
        meta = metas[k] = out["meta_info"]
        reason, matched = finish_of(meta)
        parser = plan.parser()
        content, calls = split_output(parser, out["text"]) if parser else (out["text"], [])
        reason = finish_reason(reason, bool(calls))
        message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": None,
            "tool_calls": [c.openai() for c in calls] or None,
        }
        choice: dict[str, Any] = {"index": k, "message": message, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = chat_logprobs(rt.tokenizer, *logprob_rows(meta, echo=False))
        choices.append({**choice, "finish_reason": reason, "matched_stop": matched})
    body = {**head, "choices": choices, "usage": _usage(state, req, metas)}
    return JSONResponse(body, headers=unenforced_headers(metas.values()))


async def _chat_chunks(
    state: AppState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    results: AsyncGenerator[dict[str, Any], None],
    head: dict[str, Any],
) -> AsyncGenerator[dict[str, Any], None]:
    """Per index: a role chunk, content chunks and tool-call chunks (each call whole, in one
    delta, once its JSON is complete), then one chunk with an empty delta that carries
    finish_reason and matched_stop; an optional usage chunk (choices: []) at the end."""
    metas: dict[int, dict[str, Any]] = {}
    parsers: dict[int, ToolCallParser | None] = {}
    tokenizer = state.rt.tokenizer

    def chunk(
        k: int, delta: dict[str, Any], logprobs: Any = None, reason: Any = None, matched: Any = None
    ) -> dict[str, Any]:
        choice = {
            "index": k,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        return _with_usage({**head, "choices": [choice]}, state, req, metas, continuous=True)

    async with aclosing(results):
        async for delta in results:
            k = int(delta.get("index", 0))
            first = k not in metas
            meta = metas[k] = delta["meta_info"]
            if first:
                parsers[k] = plan.parser()
                yield chunk(k, {"role": "assistant", "content": "", "reasoning_content": None})
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(tokenizer, *logprob_rows(meta, echo=False))
            reason, matched = finish_of(meta)
            parser = parsers[k]
            if parser is None:
                if delta["text"] or (logprobs and logprobs["content"]):
                    yield chunk(k, {"content": delta["text"]}, logprobs)
            else:
                # NOTE: text that may still be a tool call is held back; its tokens' logprobs
                # are sent now all the same (on an empty delta when nothing is released).
                deltas = stream_deltas(parser, delta["text"], final=reason is not None)
                if not deltas and logprobs and logprobs["content"]:
                    deltas = [{}]
                for i, piece in enumerate(deltas):
                    yield chunk(k, piece, logprobs if i == 0 else None)
                reason = finish_reason(reason, parser.num_calls > 0)
            if reason is not None:
                yield chunk(k, {}, reason=reason, matched=matched)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield _with_usage({**head, "choices": []}, state, req, metas, continuous=False)


##### Shared #####


def _check_stream_options(stream: bool, has_options: bool) -> None:
    if has_options and not stream:
        raise BadRequest(
            "stream_options is only allowed when stream is true", 400, "stream_options"
        )


@lru_cache(maxsize=8)
def _generation_defaults(model_path: str) -> dict[str, Any]:
    """Chat sampling defaults from the model's generation_config.json (SGLang's behaviour)."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in _CHAT_DEFAULT_KEYS if config.get(k) is not None}


def _usage(
    state: AppState,
    req: CompletionRequest | ChatCompletionRequest,
    metas: Mapping[int, Mapping[str, Any]],
) -> dict[str, Any]:
    force = isinstance(req, ChatCompletionRequest) and req.return_cached_tokens_details
    return usage_of(metas, req.n, state.config.enable_cache_report, force)


def _with_usage(
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
    return {**chunk, "usage": _usage(state, req, metas)}


async def _collect(
    request: Request, manager: TokenizerManager, states: list[ReqState]
) -> list[dict[str, Any]]:
    def abort_all() -> None:
        for s in states:
            manager.abort(s.rid)

    outs: list[dict[str, Any]] = await until_done_or_disconnect(
        request, manager.collect(states), abort_all
    )
    return outs
