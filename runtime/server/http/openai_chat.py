"""OpenAI API: /v1/chat/completions (SSE included): messages rendered with the chat template, tool
calls parsed out of the output (or constrained), reasoning split from the answer
(--reasoning-parser), chat logprobs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from weft.constrain import GrammarError
from weft.constrain.reasoning import constrain_after_reasoning
from weft.constrain.validation import check_output
from weft.runtime.server.chat import normalize_messages, render_chat
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.openai_api import (
    collect,
    usage,
    v1_request,
    with_usage,
)
from weft.runtime.server.http.openai_protocol import ChatCompletionRequest
from weft.runtime.server.http.openai_results import (
    chat_logprobs,
    finish_of,
    logprob_rows,
    schema_fields,
)
from weft.runtime.server.http.responses import held_stream, openai_stream, unenforced_headers
from weft.runtime.server.http.state import AppState
from weft.runtime.server.http.tool_calls import (
    ToolPlan,
    check_arguments,
    finish_reason,
    markers_are_special,
    resolve_tool_format,
    split_output,
    stream_deltas,
)
from weft.runtime.server.http.tool_parser import ToolCallParser, ToolFormat
from weft.runtime.server.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    reasoning_format,
    split_reasoning,
    think_markers_special,
)

router = APIRouter()

_CHAT_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    state, req, lora = await v1_request(request, ChatCompletionRequest)
    state.tokenizer_for("/v1/chat/completions (its messages are text)")
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
    prompt = await state.manager.run_blocking(
        render_chat,
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
    fmt, answer_schema = _reasoning_params(state, req, params)
    rid = req.rid if isinstance(req.rid, str) else f"chatcmpl-{uuid.uuid4().hex}"
    obj = GenerateInput(
        input_ids=prompt,
        sampling_params=params,
        rid=rid,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        return_text_in_logprobs=True,
        stream=req.stream,
        lora_path=lora,
    )
    manager = state.manager
    states = await manager.submit(obj)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model}
    if req.stream:
        head["object"] = "chat.completion.chunk"
        results, headers = await held_stream(request, manager, states)
        chunks = _chat_chunks(state, req, plan, results, head, fmt, answer_schema)
        return openai_stream(chunks, headers, "/v1/chat/completions")
    outs = await collect(request, manager, states)
    choices, metas = [], {}
    for k, out in enumerate(outs):
        meta = metas[k] = out["meta_info"]
        reason, matched = finish_of(meta)
        text, reasoning = out["text"], None
        if fmt is not None:
            await _check_answer(state, meta, answer_schema, fmt, text)
            if req.separate_reasoning is not False:
                reasoning, text = split_reasoning(fmt, text)
        parser = plan.parser()
        content, calls = split_output(parser, text) if parser else (text, [])
        reason = finish_reason(reason, bool(calls))
        tool_calls = [c.openai() for c in calls]
        if tool_calls:
            await state.manager.run_blocking(check_arguments, plan, tool_calls)
        message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning or None,
            "tool_calls": tool_calls or None,
        }
        choice: dict[str, Any] = {"index": k, "message": message, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = chat_logprobs(rt.tokenizer, *logprob_rows(meta, echo=False))
        choice.update(finish_reason=reason, matched_stop=matched, **schema_fields(meta))
        choices.append(choice)
    body = {**head, "choices": choices, "usage": usage(state, req, metas)}
    return JSONResponse(body, headers=unenforced_headers(metas.values()))


async def _chat_chunks(
    state: AppState,
    req: ChatCompletionRequest,
    plan: ToolPlan,
    results: AsyncGenerator[dict[str, Any], None],
    head: dict[str, Any],
    fmt: ReasoningFormat | None = None,
    answer_schema: str | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Per index: a role chunk, reasoning_content chunks (with a reasoning parser), content
    chunks and tool-call chunks (each call whole, in one delta, once its JSON is complete, with
    its arguments' schema_valid), then one chunk with an empty delta that carries finish_reason
    and matched_stop; an optional usage chunk (choices: []) at the end."""
    metas: dict[int, dict[str, Any]] = {}
    parsers: dict[int, ToolCallParser | None] = {}
    splitters: dict[int, ReasoningStream] = {}
    texts: dict[int, str] = {}  # each output's whole text (its answer is validated at the end)
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
            **schema_fields(metas[k], reason is not None),
        }
        return with_usage({**head, "choices": [choice]}, state, req, metas, continuous=True)

    async with aclosing(results):
        async for delta in results:
            k = int(delta.get("index", 0))
            first = k not in metas
            meta = metas[k] = delta["meta_info"]
            if first:
                parsers[k] = plan.parser()
                texts[k] = ""
                if fmt is not None and req.separate_reasoning is not False:
                    splitters[k] = ReasoningStream(fmt)
                yield chunk(k, {"role": "assistant", "content": "", "reasoning_content": None})
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(tokenizer, *logprob_rows(meta, echo=False))
            reason, matched = finish_of(meta)
            text = delta["text"]
            texts[k] += text
            if fmt is not None and reason is not None:
                await _check_answer(state, meta, answer_schema, fmt, texts[k])
            if k in splitters:
                # NOTE: text that may be part of a marker is held back until the next piece
                reasoning, text = splitters[k].feed(text)
                if reason is not None:
                    more_reasoning, more_text = splitters[k].finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
                if reasoning:
                    yield chunk(k, {"reasoning_content": reasoning}, logprobs)
                    logprobs = None
            parser = parsers[k]
            if parser is None:
                if text or (logprobs and logprobs["content"]):
                    yield chunk(k, {"content": text}, logprobs)
            else:
                # NOTE: text that may still be a tool call is held back; its tokens' logprobs
                # are sent now all the same (on an empty delta when nothing is released).
                deltas = stream_deltas(parser, text, final=reason is not None)
                if not deltas and logprobs and logprobs["content"]:
                    deltas = [{}]
                for i, piece in enumerate(deltas):
                    if piece.get("tool_calls"):
                        await state.manager.run_blocking(check_arguments, plan, piece["tool_calls"])
                    yield chunk(k, piece, logprobs if i == 0 else None)
                reason = finish_reason(reason, parser.num_calls > 0)
            if reason is not None:
                yield chunk(k, {}, reason=reason, matched=matched)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield with_usage({**head, "choices": []}, state, req, metas, continuous=False)


def _reasoning_params(
    state: AppState, req: ChatCompletionRequest, params: dict[str, Any]
) -> tuple[ReasoningFormat | None, str | None]:
    """With --reasoning-parser: (its format, the JSON schema the answer is validated against).
    A thinking request's constraint starts after the reasoning (`params` rewritten: the
    constraint becomes a structural tag); markers that are special tokens stay in the text."""
    name = state.config.engine.reasoning_parser
    if name is None:
        return None, None
    fmt = reasoning_format(name)
    if req.skip_special_tokens is None and think_markers_special(state.rt.tokenizer, fmt):
        params["skip_special_tokens"] = False
    if not fmt.thinking(req.chat_template_kwargs):
        return fmt, None
    schema = params.get("json_schema")
    try:
        wrapped = constrain_after_reasoning(params, fmt.start, fmt.end, fmt.starts_inside)
    except GrammarError as e:
        raise BadRequest(f"Failed to compile the grammar: {e}", 400, "response_format") from None
    params.clear()
    params.update(wrapped)
    return fmt, schema


async def _check_answer(
    state: AppState,
    meta: dict[str, Any],
    schema: str | None,
    fmt: ReasoningFormat,
    text: str,
) -> None:
    """schema_valid (and schema_error) of a finished output whose JSON schema applied after its
    reasoning: the answer alone is validated (the grammar's own check sees the whole text)."""
    if schema is None or "schema_valid" in meta or meta.get("finish_reason") is None:
        return
    if meta["finish_reason"].get("type") == "abort":
        return
    answer = split_reasoning(fmt, text)[1]
    meta.update((await state.manager.run_blocking(check_output, schema, answer)).meta())


@lru_cache(maxsize=8)
def _generation_defaults(model_path: str) -> dict[str, Any]:
    """Chat sampling defaults from the model's generation_config.json (SGLang's behaviour)."""
    path = Path(model_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in _CHAT_DEFAULT_KEYS if config.get(k) is not None}
