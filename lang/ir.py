"""The DSL's IR: the nodes that gen/select/roles build and the one interpreter executes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.lang.choices import ChoicesMethod
    from weft.lang.params import GenParams

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Node:
    """Base of every IR node; `a + b` concatenates (strings become Constant)."""

    def __add__(self, other: Any) -> Concat:
        return Concat((self, to_node(other)))

    def __radd__(self, other: Any) -> Concat:
        return Concat((to_node(other), self))


@dataclass(frozen=True)
class Constant(Node):
    """Text appended as is."""

    text: str


@dataclass(frozen=True)
class Gen(Node):
    """A generation; its text is appended and stored in `name` (a list when n > 1)."""

    name: str | None
    params: GenParams


@dataclass(frozen=True)
class Select(Node):
    """Pick one of `choices` by scoring them; the choice is appended and stored in `name`."""

    name: str | None
    choices: tuple[str, ...]
    temperature: float
    method: ChoicesMethod
    lora: str | None = None  # None: the program's default adapter


@dataclass(frozen=True)
class RoleBegin(Node):
    """Append the chat template's prefix for `role` (a new message starts)."""

    role: str


@dataclass(frozen=True)
class RoleEnd(Node):
    """Append the chat template's suffix for `role` and record the message."""

    role: str


@dataclass(frozen=True)
class VarScopeBegin(Node):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Node):
    """Store the text appended since the matching VarScopeBegin in `name`."""

    name: str


@dataclass(frozen=True)
class Concat(Node):
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Argument(Node):
    """A program argument while tracing (no value yet)."""

    name: str

    def __format__(self, spec: str) -> str:
        raise TypeError(
            f"Cannot put argument {self.name!r} inside a f-string while tracing: "
            "write s += 'text' + arg (or s += arg) instead"
        )

    def __str__(self) -> str:
        return self.__format__("")


@dataclass(frozen=True)
class VarRef(Node):
    """`s[name]` read while tracing."""

    name: str


@dataclass(frozen=True)
class Fork(Node):
    """`s.fork(n)` recorded while tracing (the branches are traced separately)."""

    n: int


def to_node(value: Any) -> Node:
    """What `s += value` appends: a node, a string, or a list/tuple of them (concatenated)."""
    if value is None:
        raise ValueError("cannot append None to a program state (s += None)")
    if isinstance(value, Node):
        return value
    if isinstance(value, str):
        return Constant(value)
    if isinstance(value, (list, tuple)):
        return Concat(tuple(to_node(v) for v in value))
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program state: use a string, gen(), "
        "select(), a role, or a list of them (convert numbers with str())"
    )


def flatten(node: Node) -> Iterator[Node]:
    """The leaves of a node in order (Concat removed)."""
    if isinstance(node, Concat):
        for item in node.items:
            yield from flatten(item)
    else:
        yield node


def produced(node: Node) -> tuple[str | None, ...]:
    """The variable a leaf node sets: () or a 1-tuple. An unnamed gen or select sets the
    variable None, as in SGLang's interpreter (`s[None]` is the latest unnamed one)."""
    if isinstance(node, (Gen, Select, VarScopeEnd)):
        return (node.name,)
    return ()
