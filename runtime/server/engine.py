"""Engine: the offline, in-process API — starts the scheduler and detokenizer processes and talks ZMQ."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from weft.runtime.config import EngineConfig
from weft.runtime.ipc.messages import LoadLoraReq, UnloadLoraReq
from weft.runtime.server.generate_input import GenerateInput
from weft.runtime.server.launch import start_runtime
from weft.runtime.server.output import ReqState
from weft.runtime.server.tokenizer_manager import RuntimeDown

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Engine:
    """`weft.Engine(model=None, **config)`: generate offline with the full runtime.

    `model` is a HF folder, a .gguf file, or None for the packaged SmolLM2-135M-Instruct; the other
    keyword arguments are `EngineConfig` fields. Use it as a context manager or call `shutdown()`.
    `tokenizer` is None with skip_tokenizer_init (prompts are input_ids, results have no text);
    `server_info["tokenizer_source"]` says which tokenizer runs (e.g. a synthetic one).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="weft-engine", daemon=True
        )
        self._thread.start()
        try:
            self._rt = asyncio.run_coroutine_threadsafe(
                start_runtime(self.config), self._loop
            ).result()
        except BaseException:
            self._stop_loop()
            raise
        atexit.register(self.shutdown)
        self._tm = self._rt.manager
        self.tokenizer = self._rt.tokenizer
        self.info = self._rt.info
        self.model_path = self._rt.model_path
        self.server_info = self._rt.server_info
        self._procs = self._rt.children.procs

    ##### Generation #####

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """SGLang-shaped results: a dict for one prompt (n=1), else a list in input order.

        With stream=True, an iterator of deltas (new text and ids; `index` when several outputs).
        `lora_path`: the LoRA adapter's name (lora_paths, or load_lora_adapter), or one per prompt
        of a batch (None: the base model); an adapter not loaded is a ValueError.
        """
        obj = GenerateInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=rid,
            return_logprob=return_logprob,
            logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
            top_logprobs_num=0 if top_logprobs_num is None else top_logprobs_num,
            token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs,
            stream=stream,
            lora_path=lora_path,
        )
        states = self._run(self._tm.submit(obj))
        if stream:
            return self._sync_stream(states)
        outs = self._run(self._tm.collect(states))
        return _shape(obj, outs)

    async def async_generate(
        self, prompt: str | list[str] | None = None, stream: bool = False, **kwargs: Any
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like `generate`, awaitable from any event loop; stream=True gives an async iterator."""
        obj = GenerateInput(text=prompt, stream=stream, **_engine_kwargs(kwargs))
        states = await self._await(self._tm.submit(obj))
        if stream:
            return self._async_stream(states)
        outs = await self._await(self._tm.collect(states))
        return _shape(obj, outs)

    def _sync_stream(self, states: list[ReqState]) -> Iterator[dict[str, Any]]:
        agen = self._tm.results(states, stream=True)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(agen.aclose())

    async def _async_stream(self, states: list[ReqState]) -> AsyncIterator[dict[str, Any]]:
        agen = self._tm.results(states, stream=True)
        try:
            while True:
                try:
                    yield await self._await(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                await self._await(agen.aclose())

    ##### Control #####

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (with nothing done) while requests are in flight."""
        return self._run(self._tm.flush_cache()).success

    def get_state(self) -> dict[str, Any]:
        """Scheduler counters: running/waiting requests, KV pool use, tokens run, retractions."""
        return self._run(self._tm.get_state())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Serve the PEFT adapter folder `lora_path` as `lora_name` from now on (the engine must
        have started with lora_paths); ValueError with the reason if it cannot be loaded (nothing
        else changes). Returns the adapters served, name -> folder."""
        reply = self._run(self._tm.update_lora(LoadLoraReq(lora_name, str(lora_path))))
        if not reply.success:
            raise ValueError(reply.message)
        return dict(reply.adapters)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Refuse new requests for `lora_name` at once; those already sent keep it until they
        finish. ValueError for an adapter not loaded. Returns the adapters served."""
        reply = self._run(self._tm.update_lora(UnloadLoraReq(lora_name)))
        if not reply.success:
            raise ValueError(reply.message)
        return dict(reply.adapters)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters served: name -> PEFT folder."""
        return dict(self._tm.lora_adapters)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._loop.call_soon_threadsafe(self._tm.abort, rid, abort_all)

    def shutdown(self) -> None:
        """Stop every child process and the engine thread; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        asyncio.run_coroutine_threadsafe(self._rt.close(), self._loop).result(30)
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    ##### Internals #####

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeDown("the engine was shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _await(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeDown("the engine was shut down")
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return await asyncio.wrap_future(fut)


def _shape(obj: GenerateInput, outs: list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
    return outs[0] if not obj.is_batch and len(outs) == 1 else outs


_ENGINE_FIELDS = {
    "sampling_params",
    "input_ids",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "rid",
    "lora_path",
}


def _engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - _ENGINE_FIELDS)
    if unknown:
        raise ValueError(f"unknown argument(s): {', '.join(unknown)}")
    out = dict(kwargs)
    if out.get("logprob_start_len") is None:
        out.pop("logprob_start_len", None)
    if out.get("top_logprobs_num") is None:
        out.pop("top_logprobs_num", None)
    return out
