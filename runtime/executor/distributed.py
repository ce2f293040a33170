"""The tensor-parallel group of the scheduler processes: torch.distributed set-up and the few
collectives the scheduler itself needs (sharing rank 0's inbox, agreeing on sizes and tokens)."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from weft.runtime.executor.batch import Batch
from weft.runtime.ipc.messages import Message, decode, encode
from weft.runtime.models.parallel import TPInfo

logger = logging.getLogger(__name__)

# Followers wait in a broadcast for rank 0's next inbox, however long the server idles; a dead
# rank is noticed by the launcher, which stops the whole runtime (no one hangs on a collective).
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class Inbox:
    """What rank 0 received in one loop turn, in the order every rank applies it: grammars that
    compiled (indices into the grammar queue) or failed (index, reason), then the messages."""

    ready: list[int]
    failed: list[tuple[int, str]]
    msgs: list[Message]


class _WireInbox(msgspec.Struct, frozen=True):
    """An Inbox as rank 0 broadcasts it: each message in the IPC codec."""

    ready: list[int]
    failed: list[tuple[int, str]]
    msgs: list[bytes]


_INBOX = msgspec.msgpack.Encoder()
_INBOX_DEC = msgspec.msgpack.Decoder(_WireInbox)


@dataclass
class TPGroup:
    """torch.distributed over the scheduler processes. The model's collectives run on `device_group`
    (NCCL on CUDA, gloo on CPU); the scheduler's control traffic on `cpu_group` (gloo)."""

    rank: int
    size: int
    device: torch.device
    device_group: Any
    cpu_group: Any

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def model_info(self) -> TPInfo:
        return TPInfo(self.rank, self.size, self.device_group)

    def share_inbox(self, inbox: Inbox | None) -> Inbox:
        """Rank 0 passes its inbox; every rank returns it."""
        data = None
        if self.is_leader:
            assert inbox is not None
            wire = _WireInbox(inbox.ready, inbox.failed, [encode(m) for m in inbox.msgs])
            data = _INBOX.encode(wire)
        got = _INBOX_DEC.decode(self.broadcast_bytes(data))
        return Inbox(got.ready, got.failed, [decode(m) for m in got.msgs])

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank `src` passes `data`; every rank returns it."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.cpu_group)
        if self.rank == src:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, src=src, group=self.cpu_group)
        return buf.numpy().tobytes()

    def first_error(self, error: str | None) -> tuple[int, str] | None:
        """Agree on something each rank did on its own (e.g. read a file): None on every rank
        if it worked on every rank, else (the lowest failing rank, its `error`) on every rank."""
        failed = self.min_int(self.rank if error is not None else self.size)
        if failed == self.size:
            return None
        data = error.encode() if self.rank == failed and error is not None else None
        return failed, self.broadcast_bytes(data, src=failed).decode()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV pages that fit on every GPU)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def check_agree(self, value: int, what: str) -> None:
        """Every rank must hold the same `value` (e.g. a digest of the batch it is about to run):
        a divergence raises here, stopping the runtime with a message, instead of running
        mismatched collectives."""
        t = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if int(t[0]) != value or -int(t[1]) != value:
            raise RuntimeError(
                f"tensor-parallel rank {self.rank} diverged from the others on {what} "
                f"(here {value}, max {int(t[0])}, min {-int(t[1])})"
            )

    def broadcast_tokens(self, ids: torch.Tensor) -> None:
        """Rank 0's sampled tokens to every rank, in place (all ranks must agree bit for bit)."""
        dist.broadcast(ids, src=0, group=self.device_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(rank: int, size: int, device_type: str, init_method: str) -> TPGroup:
    """Join the group (blocks until all `size` ranks arrived). CUDA: rank r uses GPU r."""
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=CONTROL_TIMEOUT,
        **kwargs,
    )
    cpu_group = (
        dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        if backend == "nccl"
        else dist.group.WORLD
    )
    logger.info("tensor-parallel rank %d of %d on %s (%s)", rank, size, device, backend)
    return TPGroup(rank, size, device, dist.group.WORLD, cpu_group)


def batch_digest(batch: Batch | None) -> int:
    """A 63-bit digest of what a step runs (requests, token counts), equal on agreeing ranks."""
    if batch is None:
        return 0
    key = repr([(r.rid, r.kv_len, n) for r, n in zip(batch.reqs, batch.extend_lens, strict=True)])
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1
