"""ZMQ plumbing: private ipc:// endpoints, typed send/receive, and child-process lifetime helpers."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import zmq

from weft.runtime.ipc.messages import Message, ReadyOut, decode, encode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """Where each process listens (it binds a PULL socket; the others connect PUSH sockets)."""

    scheduler: str
    detokenizer: str
    engine: str
    tp_init: str  # torch.distributed rendezvous of the tensor-parallel scheduler ranks (a file)

    @classmethod
    def in_private_dir(cls) -> tuple[Endpoints, str]:
        path = tempfile.mkdtemp(prefix="weft-ipc-")  # created with mode 0700
        os.chmod(path, 0o700)
        sched, detok, engine = (
            f"ipc://{os.path.join(path, name)}" for name in ("sched", "detok", "engine")
        )
        ends = cls(sched, detok, engine, f"file://{os.path.join(path, 'tp-init')}")
        return ends, path


class Channel:
    """One PULL socket bound at `listen` and PUSH sockets connected to peers, with the codec."""

    def __init__(self, listen: str, peers: dict[str, str]) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(listen)
        self.push: dict[str, zmq.Socket] = {}
        for name, addr in peers.items():
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(addr)
            self.push[name] = sock
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)

    def send(self, peer: str, msg: Message) -> None:
        self.push[peer].send(encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = 0) -> Message | None:
        """One message, waiting up to timeout_ms (None: forever, 0: don't wait)."""
        if timeout_ms is not None and not self.poller.poll(timeout_ms):
            return None
        return decode(self.pull.recv())

    def recv_all(self, max_bytes: int | None = None) -> list[Message]:
        """The messages waiting, without waiting; with `max_bytes`, it stops once it has read
        that many bytes (at least one message) and leaves the rest queued in the socket."""
        out: list[Message] = []
        read = 0
        while max_bytes is None or read < max_bytes:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            read += len(data)
            out.append(decode(data))
        return out

    def close(self) -> None:
        for sock in [self.pull, *self.push.values()]:
            sock.close(linger=0)
        self.ctx.term()


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGTERM this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # pragma: no cover - non-glibc systems fall back to polling the parent pid
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable")


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def setup_child_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


T = TypeVar("T")


def run_child(
    name: str,
    log_level: str,
    listen: str | None,
    peers: dict[str, str],
    start: Callable[[Channel | None], tuple[T, dict[str, Any]]],
    serve: Callable[[T], None],
) -> None:
    """The life of a child process: start (report ReadyOut or the error to the engine), serve
    until the parent is gone, and on a crash log the traceback and exit 1. A child without a
    `listen` address (a tensor-parallel follower rank) has no channel and reports nothing."""
    die_with_parent()
    # Ctrl-C reaches the whole foreground process group; the parent decides when children stop
    # (SIGTERM), so an interrupt must not kill a child mid-step with a crash report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_child_logging(log_level, name)
    channel = Channel(listen, peers) if listen is not None else None
    try:
        obj, info = start(channel)
        # NOTE: what exists now (the model, torch, transformers: 350k-450k objects in a
        # scheduler) lives as long as the process. Frozen, the collector no longer walks it: each
        # full collection of a running scheduler took 0.1-0.3 s, a stall of several decode
        # steps. Before the ready report, so a ready child serves at once.
        gc.collect()
        gc.freeze()
        if channel is not None:
            channel.send("engine", ReadyOut(_role(name), info))
    except Exception as exc:
        logger.error("%s failed to start:\n%s", name, traceback.format_exc())
        if channel is not None:
            channel.send("engine", ReadyOut(_role(name), error=f"{type(exc).__name__}: {exc}"))
            channel.close()
        raise SystemExit(1) from exc
    try:
        serve(obj)
    except SystemExit:
        raise
    except BaseException:
        logger.critical("%s crashed:\n%s", name, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if channel is not None:
            channel.close()
        # NOTE: back to the collector before the interpreter's teardown, which would otherwise
        # find the frozen objects alive and triton's bindings would report them as leaks
        gc.unfreeze()
        gc.collect()


def _role(name: str) -> Literal["scheduler", "detokenizer"]:
    if name not in ("scheduler", "detokenizer"):
        raise ValueError(f"only the scheduler and the detokenizer report to the engine, not {name}")
    return name  # type: ignore[return-value]
