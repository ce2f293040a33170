"""Tracing: run a program body against a recorder to get its IR without calling a model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from weft.lang.chat_template import ChatTemplate
from weft.lang.ir import (
    Constant,
    Fork,
    Node,
    RoleBegin,
    RoleEnd,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    to_node,
)
from weft.lang.state import RoleMethods

MIN_WARM_PREFIX_CHARS = 64  # run_batch warms a traced constant prefix longer than this


class TracerProgramState(RoleMethods):
    """Records what a program appends. Reading `s[name]` gives a VarRef placeholder (so
    `if s["x"] == ...` takes the else branch); forks record their branches in `branches`."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.branches: list[list[TracerProgramState]] = []

    def _emit(self, node: Node) -> None:
        self.nodes.append(node)

    @property
    def last_node(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None

    def __iadd__(self, other: Any) -> TracerProgramState:
        self.nodes.append(to_node(other))
        return self

    def __getitem__(self, name: str) -> VarRef:
        return VarRef(name)

    def __setitem__(self, name: str, value: Any) -> None:
        pass

    def __contains__(self, name: str) -> bool:
        return True

    def get_var(self, name: str) -> VarRef:
        return VarRef(name)

    def set_var(self, name: str, value: Any) -> None:
        pass

    def get_meta_info(self, name: str) -> None:
        return None

    def parsed(self, name: str) -> VarRef:
        return VarRef(name)

    def text(self) -> str:
        """The constant text, with `{name}` for everything only a model run would produce."""
        return "".join(_show(leaf) for leaf in self.flatten_nodes())

    def messages(self) -> list[dict[str, str]]:
        return []

    def sync(self) -> None:
        pass

    def error(self) -> None:
        return None

    def fork(self, n: int = 1) -> TracerForks:
        self.nodes.append(Fork(n))
        branches = [TracerProgramState() for _ in range(n)]
        self.branches.append(branches)
        return TracerForks(branches)

    @contextmanager
    def copy(self) -> Iterator[TracerProgramState]:
        yield self.fork(1)[0]

    def flatten_nodes(self) -> list[Node]:
        return [leaf for node in self.nodes for leaf in flatten(node)]

    def print_graph_dfs(self, indent: int = 0) -> None:
        """Print the nodes in order, each fork's branches indented under it."""
        branches = iter(self.branches)
        for leaf in self.flatten_nodes():
            print(" " * indent + repr(leaf))
            if isinstance(leaf, Fork):
                for i, branch in enumerate(next(branches)):
                    print(" " * (indent + 2) + f"branch {i}:")
                    branch.print_graph_dfs(indent + 4)


class TracerForks:
    def __init__(self, states: list[TracerProgramState]) -> None:
        self.states = states

    def __getitem__(self, i: int) -> TracerProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[TracerProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> TracerForks:
        for i, state in enumerate(self.states):
            if callable(other):
                state += other(i)
            elif isinstance(other, (list, tuple)) and len(other) == len(self.states):
                state += other[i]
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        pass


def static_prefix(nodes: list[Node], template: ChatTemplate) -> str:
    """The text every run starts with: leading constants and role markers, up to the first
    argument, gen, select, variable read or fork."""
    text = ""
    history: tuple[str, ...] = ()
    for leaf in nodes:
        if isinstance(leaf, Constant):
            text += leaf.text
        elif isinstance(leaf, RoleBegin):
            text += template.prefix(history, leaf.role)
        elif isinstance(leaf, RoleEnd):
            text += template.suffix(history, leaf.role)
            history += (leaf.role,)
        elif not isinstance(leaf, (VarScopeBegin, VarScopeEnd)):
            break
    return text


def _show(leaf: Node) -> str:
    if isinstance(leaf, Constant):
        return leaf.text
    name = getattr(leaf, "name", None) or getattr(leaf, "role", None) or type(leaf).__name__
    return "{" + str(name) + "}"
