"""StreamExecutor: the one interpreter of the IR. One worker thread and one queue per state.

The program body only submits nodes (`s += ...` returns at once); the worker executes them in
order against the backend. Readers (`s[name]`, `s.text()`) wait on one condition variable until
the node that sets what they read is done. An exception in the worker is kept in `error`;
every later node is dropped (never executed) and every waiting reader is released.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from weft.lang.backends.base import Backend, Context, GenRequest, SelectRequest
from weft.lang.ir import (
    Argument,
    Concat,
    Constant,
    Fork,
    Gen,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    produced,
)
from weft.lang.params import SamplingArgs, resolve


class ProgramError(RuntimeError):
    """A value was read from a program whose execution failed (the cause is chained)."""


class StreamExecutor:
    def __init__(
        self,
        backend: Backend,
        defaults: SamplingArgs,
        stream: bool,
        parent: StreamExecutor | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.cond = threading.Condition()  # guards everything below; notified on every change
        self.text = ""
        # variables by name; None holds the latest unnamed gen or select (as in SGLang)
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.schemas: dict[str | None, Any] = {}  # variable -> pydantic class of its json gen
        self.messages: list[dict[str, str]] = []
        self.role: str | None = None
        self.role_start = 0
        self.history: tuple[str, ...] = ()  # roles of the finished messages
        self.scopes: dict[str, int] = {}
        self.partial: dict[str | None, str] = {}  # text so far of variables being streamed
        self.partial_meta: dict[str | None, dict[str, Any]] = {}  # and their meta so far
        self.set_names: list[str | None] = []  # variables this state set (not inherited): join
        self.error: BaseException | None = None
        self.finished = False
        self.fork_start = 0  # text and messages at the fork (a branch's own part starts there)
        self.fork_messages = 0
        self.children: list[StreamExecutor] = []
        self._pending: dict[str | None, int] = {}  # variable -> submitted producers not done
        self._dropped: set[str | None] = set()  # variables whose producer failed or was dropped
        self._submit_role: str | None = None  # the role open as seen by the program body
        if parent is not None:
            self._copy_from(parent)
        self._queue: queue.Queue[Node | None] = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="weft-program", daemon=True)
        self._worker.start()

    ##### Program side #####

    def submit(self, node: Node) -> None:
        """Queue a node; role misuse fails here, in the program body, with a clear error."""
        if self.finished:
            raise RuntimeError("this program state has ended; it cannot take more text")
        leaves = list(flatten(node))
        role = self._submit_role
        for leaf in leaves:
            if isinstance(leaf, RoleBegin):
                if role is not None:
                    raise ValueError(
                        f"Nested roles are not allowed: {leaf.role}() inside an open "
                        f"{role}() message"
                    )
                role = leaf.role
            elif isinstance(leaf, RoleEnd):
                if role != leaf.role:
                    raise ValueError(
                        f"{leaf.role}_end() without a matching {leaf.role}_begin() "
                        f"(open role: {role})"
                    )
                role = None
            elif isinstance(leaf, (Argument, VarRef, Fork)):
                raise TypeError(f"{type(leaf).__name__} nodes only exist while tracing")
        self._submit_role = role
        with self.cond:
            for leaf in leaves:
                for name in produced(leaf):
                    self._pending[name] = self._pending.get(name, 0) + 1
        self._queue.put(Concat(tuple(leaves)) if len(leaves) != 1 else leaves[0])

    def get_var(self, name: str | None) -> Any:
        with self.cond:
            known = name in self.variables or name in self._dropped
            if not known and not self._pending.get(name):
                names = sorted(n for n in self.variables if n is not None)
                raise KeyError(f"no variable {name!r} in this program (known: {names})")
            self.cond.wait_for(lambda: not self._pending.get(name))
            if name in self.variables:
                return self.variables[name]
        raise ProgramError(
            f"variable {name!r} was never set: the program failed: {self.error!r}"
        ) from self.error

    def is_pending(self, name: str | None) -> bool:
        """Whether a submitted node that sets `name` is not done yet (the caller holds cond)."""
        return bool(self._pending.get(name))

    def set_var(self, name: str | None, value: Any) -> None:
        with self.cond:
            self._set(name, value, None)

    def fail(self, error: BaseException) -> None:
        """Stop executing: the program body failed (nodes still queued are dropped)."""
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def sync(self) -> None:
        """Wait until every submitted node is executed (or dropped after an error)."""
        self._queue.join()

    def end(self) -> None:
        """Finish the queue, stop the worker, and end the branches forked from this state."""
        if not self.finished:
            self._queue.put(None)
            self._worker.join()
        for child in self.children:
            child.end()

    def fork(self, n: int) -> list[StreamExecutor]:
        """n branches copying this state; the shared prefix is prefilled first when n > 1."""
        if n < 1:
            raise ValueError(f"fork: n must be at least 1, got {n}")
        self.sync()
        if n > 1 and self.text and self.error is None:
            self.backend.cache_prefix(self.text, self.defaults.lora)
        children = [
            StreamExecutor(self.backend, self.defaults, self.stream, parent=self) for _ in range(n)
        ]
        self.children.extend(children)
        return children

    def join(self, children: list[StreamExecutor], concat: bool) -> None:
        """Gather the branches' new variables as lists (and append their texts, if `concat`)."""
        for child in children:
            child.sync()
        self.sync()
        names: list[str | None] = []
        for child in children:
            names += [n for n in child.set_names if n not in names]
        if concat and any(child.role != self.role for child in children):
            raise ValueError(
                "join('concate_and_append'): a branch opened or closed a role; it must end "
                "in the role it started in"
            )
        with self.cond:
            for name in names:
                self._set(
                    name,
                    [c.variables.get(name) for c in children],
                    [c.meta_info.get(name) for c in children],
                )
            if self.error is None:
                self.error = next((c.error for c in children if c.error is not None), None)
            if concat:
                for child in children:
                    new = child.messages[child.fork_messages :]
                    self.text += child.text[child.fork_start :]
                    self.messages += new
                    self.history += tuple(m["role"] for m in new)
            self.cond.notify_all()
        for child in children:
            child.end()

    ##### Worker side #####

    def _loop(self) -> None:
        while True:
            node = self._queue.get()
            try:
                if node is None:
                    break
                done = False
                if self.error is None:
                    try:
                        self._execute(node)
                        done = True
                    except Exception as e:  # kept for s.error(); later nodes are dropped
                        with self.cond:
                            self.error = e
                self._release(node, done)
            finally:
                self._queue.task_done()
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def _release(self, node: Node, done: bool) -> None:
        with self.cond:
            for leaf in flatten(node):
                for name in produced(leaf):
                    self._pending[name] -= 1
                    if not done and name not in self.variables:
                        self._dropped.add(name)
            self.cond.notify_all()

    def _execute(self, node: Node) -> None:
        for leaf in flatten(node):
            if isinstance(leaf, Constant):
                self._append(leaf.text)
            elif isinstance(leaf, Gen):
                self._gen(leaf)
            elif isinstance(leaf, Select):
                self._select(leaf)
            elif isinstance(leaf, RoleBegin):
                self._role_begin(leaf.role)
            elif isinstance(leaf, RoleEnd):
                self._role_end(leaf.role)
            elif isinstance(leaf, VarScopeBegin):
                self.scopes[leaf.name] = len(self.text)
            elif isinstance(leaf, VarScopeEnd):
                with self.cond:
                    self._set(leaf.name, self.text[self.scopes.pop(leaf.name) :], None)
            else:
                raise TypeError(f"cannot execute a {type(leaf).__name__} node")

    def _role_begin(self, role: str) -> None:
        """Open a message. A conversation that starts without a system message gets the one the
        chat template adds by itself as a message of its own (as SGLang inserts its template's
        default system prompt): the text is the same, and messages() shows it."""
        template = self.backend.chat_template()
        default_system = None if self.history else template.default_system(role)
        if default_system is not None:
            self._role_begin("system")
            self._append(default_system)
            self._role_end("system")
        self._append(template.prefix(self.history, role))
        with self.cond:
            self.role, self.role_start = role, len(self.text)

    def _role_end(self, role: str) -> None:
        suffix = self.backend.chat_template().suffix(self.history, role)
        with self.cond:
            content = self.text[self.role_start :].lstrip()  # as SGLang records it
            self.text += suffix
            self.messages.append({"role": role, "content": content})
            self.history += (role,)
            self.role = None
            self.cond.notify_all()

    def _context(self) -> Context:
        with self.cond:
            turn = self.text[self.role_start :] if self.role is not None else ""
            return Context(self.text, tuple(dict(m) for m in self.messages), self.role, turn)

    def _gen(self, node: Gen) -> None:
        end_of_turn = self.backend.chat_template().end_of_turn if self.role == "assistant" else None
        args = resolve(self.defaults, node.params, end_of_turn)
        req = GenRequest(self._context(), args)
        if self.stream and args.n == 1:
            meta: dict[str, Any] = {}
            parts: list[str] = []
            for delta in self.backend.generate_stream(req):
                parts.append(delta.text)
                meta = delta.meta_info or meta
                with self.cond:
                    self.text += delta.text
                    self.partial[node.name] = "".join(parts)
                    self.partial_meta[node.name] = meta
                    self.cond.notify_all()
            values: Any = "".join(parts)
            metas: Any = meta
        else:
            comps = self.backend.generate(req)
            self._append(comps[0].text)
            values = comps[0].text if args.n == 1 else [c.text for c in comps]
            metas = comps[0].meta_info if args.n == 1 else [c.meta_info for c in comps]
        with self.cond:
            self.partial.pop(node.name, None)
            self.partial_meta.pop(node.name, None)
            self.schemas[node.name] = node.params.schema_model
            self._set(node.name, values, metas)

    def _select(self, node: Select) -> None:
        lora = node.lora if node.lora is not None else self.defaults.lora
        req = SelectRequest(self._context(), node.choices, node.temperature, node.method, lora)
        decision = self.backend.select(req)
        self._append(decision.decision)
        with self.cond:
            self._set(node.name, decision.decision, decision.meta_info)

    def _append(self, text: str) -> None:
        with self.cond:
            self.text += text
            self.cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        """Set a variable (the caller holds `cond`)."""
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        if name not in self.set_names:
            self.set_names.append(name)
        self.cond.notify_all()

    def _copy_from(self, parent: StreamExecutor) -> None:
        with parent.cond:
            self.text = parent.text
            self.variables = dict(parent.variables)
            self.meta_info = dict(parent.meta_info)
            self.schemas = dict(parent.schemas)
            self.messages = [dict(m) for m in parent.messages]
            self.role, self.role_start, self.history = (
                parent.role,
                parent.role_start,
                parent.history,
            )
            self.scopes = dict(parent.scopes)
            self.error = parent.error
            self.fork_start = len(parent.text)
            self.fork_messages = len(parent.messages)
            self._submit_role = parent._submit_role
