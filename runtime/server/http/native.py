"""SGLang's native HTTP API: /generate (SSE with cumulative text), health, info, cache, abort, tokenize,
LoRA adapters loaded and unloaded while serving, /separate_reasoning."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, fields
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from weft.runtime.ipc.messages import LoadLoraReq, LoraOut, UnloadLoraReq
from weft.runtime.server.chat import chat_text, normalize_messages
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.http.errors import BadRequest
from weft.runtime.server.http.responses import (
    held_stream,
    log_stream_disconnect,
    unenforced_headers,
)
from weft.runtime.server.http.state import AppState, read_json, state_of, until_done_or_disconnect
from weft.runtime.server.output import WEIGHT_VERSION
from weft.runtime.server.reasoning import reasoning_format, split_reasoning
from weft.runtime.server.tokenizer_manager import RuntimeDown

router = APIRouter()

_INPUT_FIELDS = {f.name for f in fields(GenerateInput)} - {"extra"}
_UNSUPPORTED = ("image_data", "video_data", "audio_data", "input_embeds")
_IGNORED = ("session_id", "priority", "custom_logit_processor", "return_hidden_states", "extra_key")
# the prompt's logprob lists: whole in every event of a cumulative stream (they come at once);
# the output's (output_token_logprobs, ...) are the event's own tokens in either stream mode, with
# output_token_logprobs_length counting them all, as SGLang's frontend reads them
_INPUT_LIST_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def generate_input(body: Any) -> GenerateInput:
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    for key in _UNSUPPORTED:
        if body.get(key) is not None:
            raise ValueError(f"{key} is not supported by this server")
    unknown = set(body) - _INPUT_FIELDS - set(_UNSUPPORTED) - set(_IGNORED)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    if body.get("text") is None and body.get("input_ids") is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    kwargs = {k: v for k, v in body.items() if k in _INPUT_FIELDS and v is not None}
    return GenerateInput(**kwargs)


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    state = state_of(request)
    obj = generate_input(await read_json(request))
    manager = state.manager
    states = await manager.submit(obj)

    def abort_all() -> None:
        for s in states:
            manager.abort(s.rid)

    if obj.stream:
        events, headers = await held_stream(request, manager, states)
        stream = _sse(events, len(states) > 1, state)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    outs = await until_done_or_disconnect(request, manager.collect(states), abort_all)
    single = not obj.is_batch and len(outs) == 1
    headers = unenforced_headers(out["meta_info"] for out in outs)
    return JSONResponse(outs[0] if single else outs, headers=headers)


async def _sse(
    results: AsyncIterator[dict[str, Any]], multi: bool, state: AppState
) -> AsyncIterator[bytes]:
    """SGLang's stream: every event has the request's text, ids and prompt logprobs so far (or
    deltas, with --incremental-streaming-output) and the logprobs of its own new tokens."""
    totals: dict[int, dict[str, Any]] = {}
    incremental = state.config.incremental_streaming_output
    try:
        async for delta in results:
            index = delta.pop("index", 0)
            if incremental:
                event = delta
            else:
                event = _accumulate(totals.setdefault(index, {}), delta)
            if multi:
                event = {**event, "index": index}
            yield f"data: {json.dumps(event)}\n\n".encode()
    except (RuntimeDown, ValueError) as e:
        down = isinstance(e, RuntimeDown)  # the runtime died or stops: the server's fault, a 503
        err = {
            "message": str(e),
            "type": "service_unavailable" if down else "invalid_request_error",
            "code": 503 if down else 400,
            "retryable": down,
        }
        yield f"data: {json.dumps({'error': err})}\n\n".encode()
    except (asyncio.CancelledError, GeneratorExit):
        log_stream_disconnect("/generate")
        raise
    yield b"data: [DONE]\n\n"


def _accumulate(total: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """The output so far: text (none with skip_tokenizer_init), ids and prompt logprob lists
    joined; the output logprob lists stay the delta's."""
    total["output_ids"] = total.get("output_ids", []) + delta["output_ids"]
    meta = dict(delta["meta_info"])
    old = total.get("meta_info", {})
    for key in _INPUT_LIST_KEYS:
        if key in meta:
            meta[key] = old.get(key, []) + meta[key]
    total["meta_info"] = meta
    event = {"output_ids": list(total["output_ids"]), "meta_info": meta}
    if "text" not in delta:
        return event
    total["text"] = total.get("text", "") + delta["text"]
    return {"text": total["text"], **event}


@router.get("/health")
async def health(request: Request) -> Response:
    return Response(status_code=200 if state_of(request).ready else 503)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = state_of(request)
    if not state.ready:
        return Response(status_code=503)
    obj = GenerateInput(input_ids=[0], sampling_params={"max_new_tokens": 1})

    async def one() -> None:
        async for _ in state.manager.generate(obj):
            pass

    try:
        await asyncio.wait_for(one(), timeout=20)
    except (asyncio.TimeoutError, RuntimeDown):
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    rt = state_of(request).rt
    return {
        "model_path": rt.info.model_path,
        "tokenizer_path": rt.tokenizer_source.to_dict()["path"],
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": WEIGHT_VERSION,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": rt.info.model_type,
        "architectures": list(rt.info.architectures),
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    state = state_of(request)
    rt = state.rt
    internal = await rt.manager.get_state()
    cfg = state.config
    args = {**asdict(cfg.engine), **{k: v for k, v in asdict(cfg).items() if k != "engine"}}
    args.pop("api_key", None)
    return {
        **args,
        "context_length": rt.info.context_len,
        "max_total_num_tokens": rt.server_info["max_total_tokens"],
        "page_size": rt.server_info["page_size"],
        "scheduler_pid": rt.server_info.get("pid"),
        "tokenizer_source": rt.server_info["tokenizer_source"],
        "internal_states": [internal],
        "version": version("weft"),
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, timeout: float = 0.0) -> Response:
    if not math.isfinite(timeout):
        raise ValueError(f"timeout must be a finite number of seconds, got {timeout}")
    manager = state_of(request).manager
    deadline = asyncio.get_running_loop().time() + max(timeout, 0.0)
    while True:
        reply = await manager.flush_cache()
        if reply.success:
            return PlainTextResponse("Cache flushed.\n")
        if asyncio.get_running_loop().time() >= deadline:
            return PlainTextResponse(reply.message + "\n", status_code=400)
        await asyncio.sleep(0.1)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    """SGLang's body {"lora_name", "lora_path"}: serve that PEFT folder under that name from now
    on. A bad adapter (or a name in use) is a 400 with the reason, and nothing else changes."""
    state = state_of(request)
    name, path = _lora_fields(await read_json(request), "lora_name", "lora_path")
    if name == state.config.model_name:
        raise BadRequest(f"lora_name {name!r} is the base model's name: choose another", 400)
    return _lora_reply(await state.manager.update_lora(LoadLoraReq(name, path)))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    """SGLang's body {"lora_name"}: new requests for it are refused at once (a 400); those
    already sent keep it until they finish. A name not loaded is a 404."""
    (name,) = _lora_fields(await read_json(request), "lora_name")
    return _lora_reply(await state_of(request).manager.update_lora(UnloadLoraReq(name)))


def _lora_fields(body: Any, *names: str) -> list[str]:
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    unknown = set(body) - set(names)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        values.append(value)
    return values


def _lora_reply(reply: LoraOut) -> dict[str, Any]:
    if not reply.success:
        raise BadRequest(reply.message, reply.status)
    return {"success": True, "message": reply.message, "loaded_adapters": reply.adapters}


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    body = await read_json(request)
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    rid = body.get("rid", "")
    abort_all = body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise ValueError("rid must be a string and abort_all a boolean")
    if rid or abort_all:
        state_of(request).manager.abort(rid, abort_all)
    return Response(status_code=200)


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    tokenizer = state_of(request).tokenizer_for("/tokenize")
    prompt = body.get("prompt") if isinstance(body, Mapping) else None
    add_special = body.get("add_special_tokens", True) if isinstance(body, Mapping) else True
    if not isinstance(add_special, bool):
        raise ValueError("add_special_tokens must be a boolean")
    run = state_of(request).manager.run_blocking
    if isinstance(prompt, str):
        tokens = await run(tokenizer.encode, prompt, add_special_tokens=add_special)
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": state_of(request).rt.info.context_len,
        }
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        lists = [await run(tokenizer.encode, p, add_special_tokens=add_special) for p in prompt]
        return {
            "tokens": lists,
            "count": [len(t) for t in lists],
            "max_model_len": state_of(request).rt.info.context_len,
        }
    raise ValueError("prompt must be a string or a non-empty list of strings")


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    state = state_of(request)
    tokenizer, rt = state.tokenizer_for("/detokenize"), state.rt
    tokens = body.get("tokens") if isinstance(body, Mapping) else None
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ValueError("tokens must be a list of integer token ids")
    bad = [t for t in tokens if not 0 <= t < rt.info.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of the vocabulary (size {rt.info.vocab_size})")
    text = await state.manager.run_blocking(tokenizer.decode, tokens, skip_special_tokens=False)
    return {"text": text}


@router.post("/apply_chat_template")
async def apply_chat_template(request: Request) -> dict[str, Any]:
    """weft extension: render messages with the server's chat template (what /v1/chat uses), so
    a client (the DSL's RuntimeEndpoint) builds exactly the same prompt tokens."""
    body = await read_json(request)
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    state = state_of(request)
    tokenizer = state.tokenizer_for("/apply_chat_template")
    messages = normalize_messages(body.get("messages"))
    add_gen = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    if not isinstance(add_gen, bool) or not isinstance(cont, bool):
        raise ValueError("add_generation_prompt and continue_final_message must be booleans")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list of tool definitions")
    run = state.manager.run_blocking
    text = await run(
        chat_text,
        tokenizer,
        messages,
        chat_template=state.chat_template,
        tools=tools,
        add_generation_prompt=add_gen,
        continue_final_message=cont,
    )
    ids = await run(tokenizer.encode, text, add_special_tokens=False)
    return {"text": text, "input_ids": ids}


@router.post("/separate_reasoning")
async def separate_reasoning(request: Request) -> dict[str, Any]:
    """SGLang's: {text, reasoning_parser} -> {text: the answer, reasoning_text}; the parser
    defaults to the server's --reasoning-parser (/generate itself returns the text as is)."""
    body = await read_json(request)
    if not isinstance(body, Mapping):
        raise ValueError("the request body must be a JSON object")
    text = body.get("text")
    name = body.get("reasoning_parser") or state_of(request).config.engine.reasoning_parser
    if not isinstance(text, str):
        raise ValueError("text must be a string")
    if name is None:
        raise ValueError(
            "reasoning_parser is required: this server runs without --reasoning-parser"
        )
    if not isinstance(name, str):
        raise ValueError("reasoning_parser must be a string")
    reasoning, answer = split_reasoning(reasoning_format(name), text)
    return {"text": answer, "reasoning_text": reasoning or ""}
