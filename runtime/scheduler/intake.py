"""Intake: what reaches the scheduler, collected (messages, finished grammar compiles) and turned
into requests: new ones checked and queued (constrained ones once their grammar compiled),
aborted ones finished."""

from __future__ import annotations

import logging
from typing import Any

import torch

from weft.constrain import GrammarError
from weft.runtime.executor.distributed import Inbox
from weft.runtime.executor.sampler import make_generator
from weft.runtime.ipc.channel import Channel, parent_alive
from weft.runtime.ipc.messages import (
    AbortReq,
    BatchGenerateReq,
    FinishReason,
    Message,
    TokenizedGenerateReq,
)
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.scheduler.cache_manager import KVCacheManager
from weft.runtime.scheduler.finish import StopState
from weft.runtime.scheduler.grammar import GrammarQueue, grammar_spec
from weft.runtime.scheduler.request import Queues, Req

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 200
GRAMMAR_POLL_MS = 2  # while grammars compile, look for finished ones this often
# messages read per loop pass, in bytes (at least one message): a large generate call arrives
# in parts (request_parts.BATCH_PART_TOKENS), and the parts not read yet wait in the socket
# while the steps launched run, instead of all being decoded before the first step
RECV_BYTES = 1 << 20


class Intake:
    """Rank 0's channel reader, and every rank's turn of arrivals into queued requests."""

    def __init__(
        self,
        channel: Channel | None,
        queues: Queues,
        cache: KVCacheManager,
        grammars: GrammarQueue,
        info: ModelInfo,
        tokenizer: Any,
        device: torch.device,
        max_total_tokens: int,
        lora_names: frozenset[str] = frozenset(),
    ) -> None:
        self.channel = channel
        self.queues = queues
        self.cache = cache
        self.grammars = grammars
        self.info = info
        self.tokenizer = tokenizer
        self.device = device
        self.max_total_tokens = max_total_tokens
        self.lora_names = lora_names  # the LoRA adapters served
        self.arrivals = 0

    def collect(self, parent_pid: int, busy: bool, poll: bool = False) -> Inbox:
        """Rank 0: messages and finished grammar compiles; blocks while there is nothing to do
        (not `busy` and nothing arrived), or with `poll` (work finishing off the loop, such as
        a LoRA adapter read) for one poll interval at most."""
        assert self.channel is not None
        msgs = self.channel.recv_all(RECV_BYTES)
        ready, failed = self.grammars.scan()
        while not msgs and not ready and not failed and not busy:
            compiling = bool(self.grammars.pending) or poll
            msg = self.channel.recv(GRAMMAR_POLL_MS if compiling else IDLE_POLL_MS)
            if msg is not None:
                msgs.append(msg)
            elif not parent_alive(parent_pid):
                raise SystemExit("parent process is gone")
            ready, failed = self.grammars.scan()
            if poll:
                break
        return Inbox(ready, failed, msgs)

    @staticmethod
    def controls(inbox: Inbox) -> bool:
        """Whether the inbox holds anything but new requests (those see the in-flight step
        processed first: an abort, a flush, a state read)."""
        return any(not isinstance(m, (TokenizedGenerateReq, BatchGenerateReq)) for m in inbox.msgs)

    def admit_compiled(self, inbox: Inbox) -> list[Req]:
        """Constrained requests whose grammar compiled join the waiting queue; returns those
        whose grammar failed, finished with the reason."""
        if not inbox.ready and not inbox.failed:
            return []
        ready, failed = self.grammars.take(inbox.ready, inbox.failed)
        self.queues.waiting += ready
        for req, message in failed:
            req.finish = FinishReason("abort", message=message, status=400)
        return [req for req, _ in failed]

    def handle(self, msg: Message) -> list[Req]:
        """A new request (or a batch of them) queued, or an abort done; returns the requests
        finished by it (refused, aborted)."""
        if isinstance(msg, BatchGenerateReq):
            return [req for one in msg.reqs for req in self.handle(one)]
        if isinstance(msg, TokenizedGenerateReq):
            try:
                refused = self.add_request(msg)
            except Exception as e:  # a bug, but only this request may pay for it
                logger.exception("could not admit request %s", msg.rid)
                refused = Req.from_msg(msg, msg.max_new_tokens, self.arrivals)
                refused.finish = FinishReason("abort", message=f"internal error: {e}", status=500)
            return [] if refused is None else [refused]
        if isinstance(msg, AbortReq):
            return self.abort(msg)
        logger.error("scheduler got an unexpected message %s", type(msg).__name__)
        return []

    def add_request(self, msg: TokenizedGenerateReq) -> Req | None:
        """Queue a new request (or submit its grammar); returns it if refused (finished)."""
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
            return req
        if req.lora_path is not None and req.lora_path not in self.lora_names:
            served = ", ".join(sorted(self.lora_names)) or "none"
            message = f"unknown LoRA adapter {req.lora_path!r} (loaded: {served})"
            req.finish = FinishReason("abort", message=message, status=400)
            return req
        if req.params.sampling_seed is not None:
            req.generator = make_generator(req.params.sampling_seed, self.device)
        req.stop_state = StopState.for_req(req, self.tokenizer)
        try:
            spec = grammar_spec(req.params)
            if req.params.thinking_budget is not None:
                self.grammars.markers()  # a GrammarError where no budget can apply
            if spec is not None:
                self.grammars.submit(req, spec)
            elif req.params.thinking_budget is not None:
                req.grammar = self.grammars.with_budget(req, None)
        except GrammarError as e:
            req.finish = FinishReason("abort", message=str(e), status=400)
            return req
        if spec is None:
            self.queues.waiting.append(req)
        return None

    def abort(self, msg: AbortReq) -> list[Req]:
        """Finish the requests `msg` names (or all), wherever they are; returns them."""

        def hit(r: Req) -> bool:
            return msg.abort_all or r.rid == msg.rid

        queues = self.queues
        aborted = [r for r in queues.waiting if hit(r)]
        queues.waiting = [r for r in queues.waiting if not hit(r)]
        aborted += self.grammars.remove(None if msg.abort_all else {msg.rid})
        for req in [*queues.running, *([queues.chunked] if queues.chunked else [])]:
            if hit(req):
                self.cache.cache_req(req, release=True)
                aborted.append(req)
        queues.running = [r for r in queues.running if not hit(r)]
        if queues.chunked is not None and hit(queues.chunked):
            queues.chunked = None
        for req in aborted:
            req.finish = FinishReason("abort", message=msg.message or "aborted by request")
        return aborted
