"""@weft.function programs: run, run_batch (thread pool, progress bar), bind, run_async, trace."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, overload

from weft.lang.api import resolve_backend
from weft.lang.backends.base import Backend
from weft.lang.interpreter import StreamExecutor
from weft.lang.ir import Argument
from weft.lang.params import SamplingArgs, as_ids, as_lora, as_strs
from weft.lang.state import ProgramState
from weft.lang.tracer import MIN_WARM_PREFIX_CHARS, TracerProgramState, static_prefix

logger = logging.getLogger(__name__)

BATCH_CHUNK = 200  # generator_style run_batch yields in chunks of this many programs


class Program:
    """A function `def prog(s, ...)` made into a DSL program (see `weft.function`)."""

    def __init__(
        self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None
    ) -> None:
        self.func = func
        self.name = getattr(func, "__qualname__", repr(func))
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters.values())
        if not params or params[0].name != "s":
            first = params[0].name if params else "nothing"
            raise TypeError(
                f"@weft.function {self.name}: the first parameter must be the program state, "
                f"named 's' (def {getattr(func, '__name__', 'prog')}(s, ...)); got {first}"
            )
        self.arg_names = [p.name for p in params[1:]]
        self.bind_arguments = dict(bind_arguments or {})
        free = [p for p in params[1:] if p.name not in self.bind_arguments]
        self.free_names = [
            p.name for p in free if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD
        ]
        self.num_required = sum(
            1 for p in free if p.default is p.empty and p.name in self.free_names
        )
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<weft program {self.name}({', '.join(self.arg_names)})>"

    def bind(self, **kwargs: Any) -> Program:
        """A new program with these arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(
                f"{self.name}.bind(): unknown argument(s) {', '.join(unknown)}; "
                f"the program takes {', '.join(self.arg_names) or 'no arguments'}"
            )
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`prog(...)` is `prog.run(...)`; `prog(s, ...)` inside another program runs this
        program's body on that state (composition)."""
        if args and isinstance(args[0], (ProgramState, TracerProgramState)):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    ##### Running #####

    def run(
        self,
        *args: Any,
        max_new_tokens: int | None = 128,
        n: int = 1,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_regex: str | Sequence[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        lora: str | None = None,
        stream: bool = False,
        backend: Any = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program; the sampling keywords are the defaults of every gen in it, and
        `lora` the LoRA adapter (by name) of every gen and select that names none.

        Without stream the call returns once everything is generated; with stream=True it
        returns at once and `s.text_iter()` follows the generation."""
        b = resolve_backend(backend)
        bound = self._bind(args, kwargs)
        defaults = SamplingArgs(
            max_new_tokens=max_new_tokens,
            n=n,
            stop=as_strs("stop", stop) or (),
            stop_token_ids=as_ids("stop_token_ids", stop_token_ids) or (),
            stop_regex=as_strs("stop_regex", stop_regex) or (),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=bool(return_logprob),
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=bool(return_text_in_logprobs),
            lora=as_lora("run", lora),
        )
        return self._run(b, bound, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **defaults: Any,
    ) -> Any:
        """Run once per item (a dict of arguments, or a tuple/list mapped onto them in order) on
        a thread pool; the states come back in input order. The keyword defaults are run()'s.
        A constant prefix (longer than 64 characters) that every item starts with is prefilled
        once first. `generator_style=True` yields the states lazily, in order."""
        if not batch_kwargs:
            return []
        if "stream" in defaults:
            raise TypeError("run_batch does not stream: use run(stream=True) per program")
        b = resolve_backend(backend)
        items = [self._bind_item(i, item) for i, item in enumerate(batch_kwargs)]
        unknown = sorted(set(defaults) - set(RUN_DEFAULTS))
        if unknown:
            raise TypeError(f"run_batch: unknown keyword argument(s) {', '.join(unknown)}")
        state_defaults = {**RUN_DEFAULTS, **defaults}
        lora = as_lora("run_batch", state_defaults["lora"])
        if len(items) > 1:
            self._warm(b, MIN_WARM_PREFIX_CHARS, lora)
        if num_threads == "auto":
            threads = min(max(96, 16 * (os.cpu_count() or 1)), len(items))
        elif isinstance(num_threads, int) and num_threads >= 1:
            threads = min(num_threads, len(items))
        else:
            raise ValueError(
                f"run_batch: num_threads must be 'auto' or a positive int, got {num_threads!r}"
            )

        def one(item: dict[str, Any]) -> ProgramState:
            return self.run(**item, **state_defaults, backend=b)

        if generator_style:
            return _lazy(one, items, threads)
        with ThreadPoolExecutor(threads, thread_name_prefix="weft-batch") as pool:
            futures = [pool.submit(one, item) for item in items]
            if progress_bar:
                from tqdm import tqdm

                for _ in tqdm(as_completed(futures), total=len(futures), desc=self.name):
                    pass
            return [f.result() for f in futures]

    async def run_async(self, *args: Any, **kwargs: Any) -> ProgramState:
        """`await prog.run_async(...)`: run() in a worker thread."""
        return await asyncio.to_thread(lambda: self.run(*args, **kwargs))

    ##### Tracing and prefix warming #####

    def trace(self, backend: Any = None, **kwargs: Any) -> TracerProgramState:
        """The program's IR, built without a model: arguments not given are placeholders.
        (`backend` is accepted for SGLang compatibility; tracing never uses one.)"""
        tracer = TracerProgramState()
        args = {name: Argument(name) for name in self.free_names if name not in kwargs}
        self.func(tracer, **{**self.bind_arguments, **args, **kwargs})
        return tracer

    def cache(self, backend: Any = None, lora: str | None = None) -> str:
        """Prefill the constant prefix every run starts with (under the LoRA adapter `lora`);
        returns it ("" if none)."""
        return self._warm(resolve_backend(backend), 0, as_lora("cache", lora))

    def _warm(self, backend: Backend, min_chars: int, lora: str | None = None) -> str:
        try:
            nodes = self.trace().flatten_nodes()
        except Exception as e:  # tracing is best effort: the program may compute on its arguments
            logger.debug("no prefix warming for %s: tracing failed: %s", self.name, e)
            return ""
        prefix = static_prefix(nodes, backend.chat_template())
        if len(prefix) > min_chars:
            backend.cache_prefix(prefix, lora)
            return prefix
        return ""

    ##### Internals #####

    def _bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            return self.signature.bind(None, *args, **{**self.bind_arguments, **kwargs})
        except TypeError as e:
            raise TypeError(f"program {self.name}({', '.join(self.arg_names)}): {e}") from None

    def _bind_item(self, i: int, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            kwargs = dict(item)
        elif isinstance(item, (list, tuple)):
            lo, hi = self.num_required, len(self.free_names)
            if not lo <= len(item) <= hi:
                raise ValueError(
                    f"run_batch item {i}: given {len(item)} arguments, but {self.name} takes "
                    f"{lo} to {hi} ({', '.join(self.free_names)}) (Given arguments mismatch the "
                    "SGL function signature)"
                )
            kwargs = dict(zip(self.free_names, item, strict=False))
        else:
            raise TypeError(
                f"run_batch item {i}: expected a dict or a tuple/list of arguments, "
                f"got {type(item).__name__}"
            )
        try:
            self._bind((), kwargs)
        except TypeError as e:
            raise TypeError(f"run_batch item {i}: {e}") from None
        return kwargs

    def _run(
        self, backend: Backend, bound: inspect.BoundArguments, defaults: SamplingArgs, stream: bool
    ) -> ProgramState:
        ex = StreamExecutor(backend, defaults, stream)
        state = ProgramState(ex)
        if stream:
            threading.Thread(
                target=self._body, args=(ex, state, bound), name="weft-body", daemon=True
            ).start()
            return state
        try:
            self.func(state, *bound.args[1:], **bound.kwargs)
        except BaseException as e:
            ex.fail(e)
            raise
        finally:
            ex.end()
        return state

    def _body(self, ex: StreamExecutor, state: ProgramState, bound: inspect.BoundArguments) -> None:
        try:
            self.func(state, *bound.args[1:], **bound.kwargs)
        except Exception as e:  # a streamed program reports body errors through s.error()
            ex.fail(e)
        finally:
            ex.end()


# run()'s sampling keywords and their defaults (run_batch takes the same)
RUN_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "n": 1, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "return_logprob": None,
    "logprob_start_len": None, "top_logprobs_num": None, "return_text_in_logprobs": None,
    "lora": None,
}  # fmt: skip


def _lazy(
    one: Callable[[dict[str, Any]], ProgramState], items: list[dict[str, Any]], threads: int
) -> Iterator[ProgramState]:
    with ThreadPoolExecutor(threads, thread_name_prefix="weft-batch") as pool:
        for start in range(0, len(items), BATCH_CHUNK):
            futures = [pool.submit(one, item) for item in items[start : start + BATCH_CHUNK]]
            for f in futures:
                yield f.result()


@overload
def function(func: Callable[..., Any]) -> Program: ...


@overload
def function(func: None = None) -> Callable[[Callable[..., Any]], Program]: ...


def function(
    func: Callable[..., Any] | None = None,
) -> Program | Callable[[Callable[..., Any]], Program]:
    """`@weft.function` (or `@weft.function()`): make `def prog(s, ...)` a program."""
    if func is None:
        return Program
    return Program(func)
