"""TokenizerManager (asyncio): check and tokenize requests, send them to the scheduler, gather results."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from weft.constrain.validation import check_output
from weft.runtime.ipc.messages import (
    AbortReq,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStateReq,
    LoadLoraReq,
    LoraOut,
    Message,
    StateOut,
    StrOut,
    TokenizedGenerateReq,
    UnloadLoraReq,
    decode,
    encode,
)
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.server.generate_input import GenerateInput, PromptSpec, no_tokenizer
from weft.runtime.server.limits import RequestLimits, check_text_fits, max_chars_per_token
from weft.runtime.server.output import ReqState, build_output, schema_to_check
from weft.runtime.server.request_parts import aborted, encode_parts, prefill_only, sample_j

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
# NOTE: tokenization, chat templates and logprob token texts run on these threads, never on the
# event loop: a 10M-character prompt takes seconds to tokenize (the Rust part releases the GIL).
TOKENIZER_THREADS = 4

T = TypeVar("T")


class RuntimeDown(RuntimeError):
    """A child process died (or the server is shutting down); no request can be served any more."""


class TokenizerManager:
    def __init__(
        self,
        tokenizer: Any,
        info: ModelInfo,
        max_total_tokens: int,
        scheduler_addr: str,
        listen_addr: str,
        check_children: Callable[[], str | None],
        limits: RequestLimits | None = None,
        lora_adapters: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # the LoRA adapters served (name -> folder), replaced whole when one is (un)loaded: a
        # request for another is refused here, before it is sent
        self.lora_adapters: dict[str, str] = dict(lora_adapters or {})
        self.limits = limits or RequestLimits()
        self.max_token_chars = max_chars_per_token(tokenizer)
        self.info = info
        self.max_total_tokens = max_total_tokens
        self.ctx = zmq.asyncio.Context()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(scheduler_addr)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(listen_addr)
        self.check_children = check_children
        self.states: dict[str, ReqState] = {}
        self.control: asyncio.Queue[Message] = asyncio.Queue()
        self.control_lock = asyncio.Lock()
        self.down: str | None = None
        self.closing: str | None = None  # set by stop_accepting(): new requests are refused
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="weft-tokenize")
        self.tasks: list[asyncio.Task[None]] = []
        # called on every output: (state, the output, the previous token time) — e.g. metrics
        self.observers: list[Callable[[ReqState, StrOut, float | None], None]] = []

    def start(self) -> None:
        self.tasks = [
            asyncio.ensure_future(self._recv_loop()),
            asyncio.ensure_future(self._watch()),
        ]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.to_scheduler.close(linger=0)
        self.inbox.close(linger=0)
        self.ctx.term()

    ##### Requests #####

    async def generate(self, obj: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """Submit and yield results: every output at the end, or deltas as they come (stream)."""
        states = await self.submit(obj)
        async for out in self.results(states, obj.stream):
            yield out

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a tokenizer thread: what may take long (tokenizing, rendering a
        chat template, decoding many ids) never stalls the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def submit(self, obj: GenerateInput) -> list[ReqState]:
        """Check, tokenize and send every output of the request; ValueError on bad input."""
        self._raise_if_closed()
        specs, ids = await self.run_blocking(self._prepare, obj)
        self._raise_if_closed()  # it may have stopped while the prompts were tokenized
        n = specs[0].params.n
        if n > 1:  # prefill each prompt once so the n samples share it through the radix cache
            warm = [
                (prefill_only(s), p, f"{s.rid}-prefill") for s, p in zip(specs, ids, strict=True)
            ]
            warmed = await self.collect(self._submit(warm))
            any_aborted = any(aborted(out) for out in warmed)
            if any_aborted and self.closing is not None:  # the shutdown's abort came first
                raise RuntimeDown(self.closing)
        outputs = [
            (
                spec if n == 1 else sample_j(spec, j),
                prompt,
                spec.rid if n == 1 else f"{spec.rid}-{j}",
            )
            for spec, prompt in zip(specs, ids, strict=True)
            for j in range(n)
        ]
        return self._submit(outputs)

    async def results(
        self, states: list[ReqState], stream: bool
    ) -> AsyncGenerator[dict[str, Any], None]:
        try:
            if stream:
                async for out in self._stream(states):
                    yield out
            else:
                for out in await self.collect(states):
                    yield out
        finally:
            for state in states:
                if not state.finished:
                    self.abort(state.rid)

    def _prepare(self, obj: GenerateInput) -> tuple[list[PromptSpec], list[list[int]]]:
        """(specs, prompt ids): checked against the limits, tokenized, and checked against the
        context and the pool; runs on a tokenizer thread and touches no shared state."""
        specs = obj.specs()
        for spec in specs:
            self.limits.check(spec)
        if len({s.params.n for s in specs}) > 1:
            raise ValueError("all prompts of a batch must use the same sampling parameter n")
        ids = [self._tokenize(s) for s in specs]
        for spec, prompt in zip(specs, ids, strict=True):
            self._check(spec, prompt)
        return specs, ids

    def _tokenize(self, spec: PromptSpec) -> list[int]:
        if self.tokenizer is None:  # skip_tokenizer_init: ids only, and nothing that reads text
            needs = spec.needs_tokenizer()
            if needs is not None:
                raise no_tokenizer(needs)
        if spec.input_ids is not None:
            return spec.input_ids
        assert spec.text is not None
        check_text_fits(spec.text, self.max_token_chars, self.info.context_len)
        return list(self.tokenizer.encode(spec.text))

    def _check(self, spec: PromptSpec, prompt: list[int]) -> None:
        p = spec.params
        self.check_lora(spec.lora_path)
        if prompt and max(prompt) >= self.info.vocab_size:
            bad = next(t for t in prompt if t >= self.info.vocab_size)
            raise ValueError(
                f"input_ids contain out-of-vocabulary token id {bad} (vocab size {self.info.vocab_size})"
            )
        p.verify_vocab(self.info.vocab_size)
        for t in spec.token_ids_logprob:
            if t >= self.info.vocab_size:
                raise ValueError(f"token_ids_logprob contains out-of-vocabulary token id {t}")
        if spec.logprob_start_len >= len(prompt):
            raise ValueError(
                f"logprob_start_len ({spec.logprob_start_len}) must be less than the prompt length ({len(prompt)})"
            )
        max_new = self.info.resolve_max_new_tokens(
            p.max_new_tokens, len(prompt), self.max_total_tokens
        )
        problem = self.info.check_request(len(prompt), max_new, self.max_total_tokens)
        if problem is not None:
            raise ValueError(problem)

    def _submit(self, outputs: list[tuple[PromptSpec, list[int], str]]) -> list[ReqState]:
        """Register the outputs (spec, prompt ids, rid) of one call and send them together, so the
        scheduler admits them together (in parts: request_parts.BATCH_PART_TOKENS);
        all or none (a rid already running refuses all). The rids of one call are distinct
        (GenerateInput checks; samples add "-j")."""
        taken = [rid for _, _, rid in outputs if rid in self.states]
        if taken:
            raise ValueError(f"a request with rid {taken[0]!r} is already running")
        states: list[ReqState] = []
        msgs: list[TokenizedGenerateReq] = []
        for spec, prompt, rid in outputs:
            max_new = self.info.resolve_max_new_tokens(
                spec.params.max_new_tokens, len(prompt), self.max_total_tokens
            )
            states.append(ReqState(spec, prompt, rid, len(states)))
            msgs.append(
                TokenizedGenerateReq(
                    rid=rid,
                    input_ids=prompt,
                    params=spec.params,
                    max_new_tokens=max_new,
                    return_logprob=spec.return_logprob,
                    logprob_start_len=spec.logprob_start_len if spec.return_logprob else -1,
                    top_logprobs_num=spec.top_logprobs_num,
                    token_ids_logprob=spec.token_ids_logprob,
                    stream=spec.stream,
                    lora_path=spec.lora_path,
                )
            )
        payloads = encode_parts(msgs)
        for state in states:
            self.states[state.rid] = state
        for payload in payloads:
            self.to_scheduler.send(payload)
        return states

    async def collect(self, states: list[ReqState]) -> list[dict[str, Any]]:
        for state in states:
            while not state.finished:
                await self._wait(state)
        return [await self._output(s, final=True) for s in states]

    async def _output(self, state: ReqState, final: bool) -> dict[str, Any]:
        """build_output, on a tokenizer thread when it decodes logprob token texts (a prompt's
        input logprobs may be many thousands); the pieces are taken here, on the loop. A
        finished JSON-schema output is validated first, on a thread (output.schema_to_check)."""
        if self.tokenizer is not None and (schema := schema_to_check(state)) is not None:
            state.meta.update((await self.run_blocking(check_output, schema, state.text)).meta())
        if not (state.spec.return_logprob and state.spec.return_text_in_logprobs):
            return build_output(self.tokenizer, state, final)
        pieces, state.pieces = state.pieces, []
        return await self.run_blocking(build_output, self.tokenizer, state, final, pieces)

    async def _stream(self, states: list[ReqState]) -> AsyncGenerator[dict[str, Any], None]:
        pending = list(states)
        while pending:
            waiters = {asyncio.ensure_future(self._wait(s)): s for s in pending if not s.pieces}
            ready = [s for s in pending if s.pieces]
            if not ready:
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    fut.result()
            for fut in waiters:
                fut.cancel()
            for state in [s for s in pending if s.pieces]:
                if state.rejected is not None:
                    raise ValueError(state.rejected)
                out = await self._output(state, final=False)
                if len(states) > 1:
                    out["index"] = state.out_index
                yield out
            pending = [s for s in pending if not s.finished or s.pieces]

    async def _wait(self, state: ReqState) -> None:
        await state.event.wait()
        state.event.clear()
        self._raise_if_down()
        if state.rejected is not None:  # a 400 found by the scheduler (e.g. a grammar refusal)
            raise ValueError(state.rejected)

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "") -> None:
        if self.to_scheduler.closed:  # shut down: a request cancelled after close() has no one
            return  # to tell (its send would fail in a future nobody awaits)
        self.to_scheduler.send(encode(AbortReq(rid=rid, abort_all=abort_all, message=message)))

    def stop_accepting(self, reason: str) -> None:
        """Refuse new requests from now on (RuntimeDown: a 503 saying `reason`); those already
        sent run on."""
        self.closing = reason

    @property
    def in_flight(self) -> int:
        """Outputs sent and not yet finished."""
        return len(self.states)

    ##### Control #####

    async def flush_cache(self) -> FlushCacheOut:
        reply = await self._control(FlushCacheReq())
        assert isinstance(reply, FlushCacheOut)
        return reply

    async def get_state(self) -> dict[str, Any]:
        reply = await self._control(GetStateReq())
        assert isinstance(reply, StateOut)
        return reply.state

    def check_lora(self, name: str | None) -> None:
        """ValueError (a 400) for a LoRA adapter that is not served."""
        adapters = self.lora_adapters
        if name is not None and name not in adapters:
            served = ", ".join(adapters) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {served})")

    async def update_lora(self, msg: LoadLoraReq | UnloadLoraReq) -> LoraOut:
        """Load or unload an adapter in the scheduler; the adapters served follow its reply (an
        unloaded one is refused from the moment the unload is sent)."""
        if isinstance(msg, UnloadLoraReq):
            self.lora_adapters = {n: p for n, p in self.lora_adapters.items() if n != msg.name}
        reply = await self._control(msg)
        assert isinstance(reply, LoraOut)
        self.lora_adapters = dict(reply.adapters)
        return reply

    async def _control(self, msg: Message) -> Message:
        self._raise_if_down()
        async with self.control_lock:
            self.to_scheduler.send(encode(msg))
            reply = await self.control.get()
        self._raise_if_down()
        return reply

    ##### Background tasks #####

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self.inbox.recv())
            if isinstance(msg, BatchStrOut):
                for out in msg.outs:
                    self._deliver(out)
            else:
                await self.control.put(msg)

    def _deliver(self, out: StrOut) -> None:
        state = self.states.get(out.token.rid)
        if state is None:
            return
        prev = state.last_token_at
        state.add(out, time.perf_counter())
        if state.finished:
            del self.states[state.rid]
        for observe in self.observers:
            observe(state, out, prev)
        state.event.set()

    async def _watch(self) -> None:
        while self.down is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            problem = self.check_children()
            if problem is not None:
                self.set_down(problem)

    def set_down(self, reason: str) -> None:
        self.down = reason
        logger.error("weft runtime is down: %s", reason)
        for state in list(self.states.values()):
            state.event.set()
        self.control.put_nowait(StateOut({"error": reason}))

    def _raise_if_down(self) -> None:
        if self.down is not None:
            raise RuntimeDown(f"weft runtime is down: {self.down}")

    def _raise_if_closed(self) -> None:
        """For a new request: down, or no longer accepting (shutting down)."""
        self._raise_if_down()
        if self.closing is not None:
            raise RuntimeDown(self.closing)
