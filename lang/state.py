"""ProgramState (the `s` of a program) and ForkedStates (the branches of `s.fork(n)`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from weft.lang.interpreter import StreamExecutor
from weft.lang.ir import Node, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, to_node


class RoleScope:
    """`with s.user():` opens a message on enter and closes it on exit (a no-op when the role
    was given its content directly, as in `s.user("hi")`)."""

    def __init__(self, submit: Callable[[Node], None], role: str, active: bool) -> None:
        self._submit, self._role, self._active = submit, role, active

    def __enter__(self) -> None:
        if self._active:
            self._submit(RoleBegin(self._role))

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._active and exc_type is None:
            self._submit(RoleEnd(self._role))


S = TypeVar("S", bound="RoleMethods")


class RoleMethods:
    """`s.system/user/assistant(...)` and `s.var_scope(name)`, written once for every state kind:
    each node goes to `_emit` (the executor of a running program, the list of a traced one)."""

    def _emit(self, node: Node) -> None:
        raise NotImplementedError

    def system(self, expr: Any = None) -> RoleScope:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> RoleScope:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> RoleScope:
        return self._role("assistant", expr)

    def _role(self, role: str, expr: Any) -> RoleScope:
        if expr is not None:
            self._emit(to_node([RoleBegin(role), to_node(expr), RoleEnd(role)]))
        return RoleScope(self._emit, role, active=expr is None)

    @contextmanager
    def var_scope(self: S, name: str) -> Iterator[S]:
        """`with s.var_scope("x"):` — s["x"] becomes exactly the text appended in the block."""
        self._emit(VarScopeBegin(name))
        yield self
        self._emit(VarScopeEnd(name))


class ProgramState(RoleMethods):
    """The state a program appends to: `s += ...` queues and returns; reads wait for values."""

    def __init__(self, executor: StreamExecutor) -> None:
        self._ex = executor

    def _emit(self, node: Node) -> None:
        self._ex.submit(node)

    ##### Appending and variables #####

    def __iadd__(self, other: Any) -> ProgramState:
        self._ex.submit(to_node(other))
        return self

    def __getitem__(self, name: str | None) -> Any:
        return self._ex.get_var(name)

    def __setitem__(self, name: str | None, value: Any) -> None:
        self._ex.set_var(name, value)

    def __contains__(self, name: str | None) -> bool:
        try:
            self._ex.get_var(name)
        except KeyError:
            return False
        return True

    def get_var(self, name: str | None) -> Any:
        return self._ex.get_var(name)

    def set_var(self, name: str | None, value: Any) -> None:
        self._ex.set_var(name, value)

    def get_meta_info(self, name: str | None) -> Any:
        """The backend's meta_info of the gen/select that set `name` (a list when n > 1):
        prompt_tokens, completion_tokens, cached_tokens, finish_reason, logprobs if asked.
        None names the latest unnamed gen or select."""
        self._ex.get_var(name)
        return self._ex.meta_info.get(name)

    def parsed(self, name: str) -> Any:
        """The value of a json_schema gen, validated: a pydantic object when the schema was a
        pydantic class, else the decoded JSON."""
        text = self._ex.get_var(name)
        model = self._ex.schemas.get(name)
        if model is not None:
            return model.model_validate_json(text)
        return json.loads(text)

    ##### Whole-program views #####

    def text(self) -> str:
        self.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, str]]:
        """The finished messages, OpenAI style ({"role", "content"})."""
        self.sync()
        return [dict(m) for m in self._ex.messages]

    def sync(self) -> None:
        self._ex.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped this program's execution, or None."""
        self.sync()
        return self._ex.error

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    ##### Roles and scopes #####

    ##### Branches #####

    def fork(self, n: int = 1) -> ForkedStates:
        """n branches that start from this state's text, variables and messages. With n > 1 the
        text is prefilled once first, so every branch finds it in the prefix cache."""
        return ForkedStates(self._ex, [ProgramState(c) for c in self._ex.fork(n)])

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """`with s.copy() as c:` — a one-branch fork; its new variables are copied back on exit
        (as plain values), its text is not."""
        (child,) = self._ex.fork(1)
        yield ProgramState(child)
        child.sync()
        for name in child.set_names:
            self._ex.set_var(name, child.variables[name])
        child.end()

    ##### Streaming #####

    def text_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> Iterator[Any]:
        """The program text (or one variable's text) as it is generated. Without stream=True it
        yields the final value once.

        With return_meta_data and a variable, (chunk, meta) pairs as SGLang's text_async_iter
        gives them: meta is the gen's latest meta_info (completion_tokens so far, ...) whose
        output logprob lists (output_token_logprobs, output_top_logprobs,
        output_token_ids_logprobs) hold only the tokens new since the previous chunk; tokens
        that brought no text ride with the next chunk. The whole text comes as plain chunks."""
        ex = self._ex
        with_meta = return_meta_data and var_name is not None
        if not ex.stream:
            if var_name is None:
                yield self.text()
                return
            value = self.get_var(var_name)
            yield (value, ex.meta_info.get(var_name)) if with_meta else str(value)
            return
        pos = sent = 0
        while True:
            with ex.cond:
                ex.cond.wait_for(partial(_ready, ex, var_name, pos))
                current, done = _source(ex, var_name), _done(ex, var_name)
                meta = _meta(ex, var_name)
            if len(current) > pos:
                chunk, pos = current[pos:], len(current)
                if with_meta:
                    chunk_meta, sent = chunk_meta_info(meta, sent)
                    yield chunk, chunk_meta
                else:
                    yield chunk
            elif done:
                return

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`async for chunk in s.text_async_iter(...)`: text_iter's chunks (or, with
        return_meta_data and a variable, its (chunk, meta) pairs) without blocking the loop."""
        it = self.text_iter(var_name, return_meta_data)
        end = object()
        while True:
            item = await asyncio.to_thread(next, it, end)
            if item is end:
                return
            yield item


class ForkedStates:
    """The branches of `s.fork(n)`: index them, append to all (`forks += expr`, `forks +=
    lambda i: ...`, `forks += [e0, e1, ...]`), and `join()` them back."""

    def __init__(self, parent: StreamExecutor, states: list[ProgramState]) -> None:
        self._parent = parent
        self.states = states

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """What `forks[i] += expr` ends with (Python stores the item back): the branch itself.
        A branch cannot be replaced by anything else."""
        if value is not self.states[i]:
            raise ValueError(
                f"forks[{i}] = ...: a branch cannot be replaced; append to it with "
                f"forks[{i}] += ..."
            )

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ForkedStates:
        if callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(
                    f"forks += list: give one item per branch ({len(self.states)}), "
                    f"got {len(other)}"
                )
            for state, item in zip(self.states, other, strict=True):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. Variables they set become lists in the parent (one value per
        branch, in order). mode "concate_and_append" also appends their texts in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join: mode must be 'gather_variable' or 'concate_and_append', got {mode!r}"
            )
        self._parent.join([s._ex for s in self.states], concat=mode == "concate_and_append")


OUTPUT_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


def chunk_meta_info(meta: dict[str, Any] | None, sent: int) -> tuple[dict[str, Any] | None, int]:
    """(meta with its output logprob lists cut to the entries after the first `sent`, the
    number of entries it covers up to): the meta of one streamed chunk."""
    if meta is None:
        return None, sent
    out = dict(meta)
    upto = len(meta.get("output_token_logprobs", ()))
    for key in OUTPUT_LOGPROB_KEYS:
        if key in meta:
            out[key] = list(meta[key][sent:upto])
    return out, max(upto, sent)


def _meta(ex: StreamExecutor, var: str | None) -> Any:
    if var in ex.partial_meta:
        return ex.partial_meta[var]
    return ex.meta_info.get(var)


def _ready(ex: StreamExecutor, var: str | None, seen: int) -> bool:
    return len(_source(ex, var)) > seen or _done(ex, var)


def _source(ex: StreamExecutor, var: str | None) -> str:
    if var is None:
        return ex.text
    if var in ex.partial:
        return ex.partial[var]
    value = ex.variables.get(var, "")
    return value if isinstance(value, str) else ""


def _done(ex: StreamExecutor, var: str | None) -> bool:
    if ex.finished or ex.error is not None:
        return True
    return (
        var is not None and var in ex.variables and var not in ex.partial and not ex.is_pending(var)
    )
