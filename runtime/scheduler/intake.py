"""RequestIntake: the scheduler's handling of what arrives: messages and compiled grammars collected,
new requests, aborts, flush, state."""

from __future__ import annotations

import gc
import logging
from collections import deque
from typing import Any

from weft.constrain import GrammarError
from weft.runtime.executor.distributed import Inbox
from weft.runtime.executor.model_runner import ModelRunner
from weft.runtime.executor.sampler import make_generator
from weft.runtime.ipc.channel import Channel, parent_alive
from weft.runtime.ipc.messages import (
    AbortReq,
    BatchGenerateReq,
    FinishReason,
    FlushCacheOut,
    FlushCacheReq,
    GetStateReq,
    Message,
    StateOut,
    TokenizedGenerateReq,
)
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.finish import StopState
from weft.runtime.scheduler.grammar import GrammarQueue, grammar_spec
from weft.runtime.scheduler.request import Req

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200
GRAMMAR_POLL_MS = 2  # while grammars compile, look for finished ones this often
# messages read per loop pass, in bytes (at least one message): a large generate call arrives
# in parts (tokenizer_manager.BATCH_PART_TOKENS), and the parts not read yet wait in the socket
# while the steps launched run, instead of all being decoded before the first step
RECV_BYTES = 1 << 20


class RequestIntake:
    """Mixed into the Scheduler, whose state it reads and changes (declared below)."""

    arrivals: int
    channel: Channel | None
    info: ModelInfo
    runner: ModelRunner
    tokenizer: Any
    checked_idle: bool
    grammars: GrammarQueue
    cache: KVCacheManager
    waiting: list[Req]
    running: list[Req]
    chunked: Req | None
    new_token_ratio: float
    stats: dict[str, int]
    busy_periods: deque[tuple[float, float]]

    @property
    def max_total_tokens(self) -> int:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def emit(self, reqs: list[Req]) -> None:
        raise NotImplementedError

    def reply(self, msg: Message) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        raise NotImplementedError

    def on_idle(self) -> None:
        raise NotImplementedError

    def collect(self, parent_pid: int) -> Inbox:
        """Rank 0: messages and finished grammar compiles; blocks while there is nothing to do."""
        assert self.channel is not None
        msgs = self.channel.recv_all(RECV_BYTES)
        ready, failed = self.grammars.scan()
        while not msgs and not ready and not failed and not self.has_work():
            compiling = bool(self.grammars.pending)
            if not compiling:
                self.on_idle()
            msg = self.channel.recv(GRAMMAR_POLL_MS if compiling else IDLE_POLL_MS)
            if msg is not None:
                msgs.append(msg)
            elif not parent_alive(parent_pid):
                raise SystemExit("parent process is gone")
            ready, failed = self.grammars.scan()
        return Inbox(ready, failed, msgs)

    def apply(self, inbox: Inbox) -> None:
        """Constrained requests whose grammar compiled join the waiting queue, failures answer;
        then the messages, in order (all but new requests see the in-flight step processed)."""
        if any(not isinstance(m, (TokenizedGenerateReq, BatchGenerateReq)) for m in inbox.msgs):
            self.settle()
        if inbox.ready or inbox.failed:
            ready, failed = self.grammars.take(inbox.ready, inbox.failed)
            self.waiting += ready
            for req, message in failed:
                req.finish = FinishReason("abort", message=message, status=400)
            self.emit([req for req, _ in failed])
        for msg in inbox.msgs:
            self.handle(msg)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, BatchGenerateReq):
            for one in msg.reqs:
                self.handle(one)
        elif isinstance(msg, TokenizedGenerateReq):
            try:
                self.add_request(msg)
            except Exception as e:  # a bug, but only this request may pay for it
                logger.exception("could not admit request %s", msg.rid)
                req = Req.from_msg(msg, msg.max_new_tokens, self.arrivals)
                req.finish = FinishReason("abort", message=f"internal error: {e}", status=500)
                self.emit([req])
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, FlushCacheReq):
            self.reply(self.flush_cache())
        elif isinstance(msg, GetStateReq):
            self.reply(StateOut(self.state()))
        else:
            logger.error("scheduler got an unexpected message %s", type(msg).__name__)

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        self.arrivals += 1
        req = Req.from_msg(msg, msg.max_new_tokens, self.arrivals)
        problem = self.info.check_request(
            len(req.input_ids), req.max_new_tokens, self.max_total_tokens
        )
        if (
            problem is None
            and req.input_ids
            and (min(req.input_ids) < 0 or max(req.input_ids) >= self.info.vocab_size)
        ):
            problem = "input_ids contain a token id outside the vocabulary"
        if problem is not None:  # the engine checks these too; never trust the socket
            req.finish = FinishReason("abort", message=problem)
            self.emit([req])
            return
        if req.params.sampling_seed is not None:
            req.generator = make_generator(req.params.sampling_seed, self.runner.device)
        req.stop_state = StopState.for_req(req, self.tokenizer)
        self.checked_idle = False
        try:
            spec = grammar_spec(req.params)
            if spec is not None:
                self.grammars.submit(req, spec)
        except GrammarError as e:
            req.finish = FinishReason("abort", message=str(e), status=400)
            self.emit([req])
            return
        if spec is None:
            self.waiting.append(req)

    def abort(self, msg: AbortReq) -> None:
        def hit(r: Req) -> bool:
            return msg.abort_all or r.rid == msg.rid

        aborted = [r for r in self.waiting if hit(r)]
        self.waiting = [r for r in self.waiting if not hit(r)]
        aborted += self.grammars.remove(None if msg.abort_all else {msg.rid})
        for req in [*self.running, *([self.chunked] if self.chunked else [])]:
            if hit(req):
                self.cache.cache_req(req, release=True)
                aborted.append(req)
        self.running = [r for r in self.running if not hit(r)]
        if self.chunked is not None and hit(self.chunked):
            self.chunked = None
        for req in aborted:
            req.finish = FinishReason("abort", message="aborted by request")
        self.emit(aborted)

    def flush_cache(self) -> FlushCacheOut:
        if self.has_work() or self.grammars.pending:
            return FlushCacheOut(False, "Cache not flushed: there are running or waiting requests.")
        self.cache.tree.reset()
        return FlushCacheOut(True, "Cache flushed.")

    def state(self) -> dict[str, Any]:
        alloc = self.runner.allocator
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + (1 if self.chunked else 0),
            "max_total_tokens": self.max_total_tokens,
            "free_tokens": alloc.free_slots,
            "evictable_tokens": self.cache.tree.evictable_size(),
            "protected_tokens": self.cache.tree.protected_size(),
            "num_forward_tokens": self.runner.num_forward_tokens,
            "num_forward_passes": self.runner.num_forward_passes,
            "shared_prefix_steps": self.runner.num_shared_prefix_steps,
            "mask_fill": self.runner.mask_fill_stats(),
            "num_compiling": len(self.grammars.pending),
            "new_token_ratio": self.new_token_ratio,
            "page_size": self.runner.page_size,
            # objects the collector skips (frozen at start-up) and its passes over the rest
            "gc_frozen": gc.get_freeze_count(),
            "gc_collections": [g["collections"] for g in gc.get_stats()],
            "busy_periods": [list(p) for p in self.busy_periods],
            **self.stats,
        }
