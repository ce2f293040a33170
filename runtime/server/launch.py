"""Launching a runtime: resolve the model, start the scheduler and detokenizer processes, and wire a
TokenizerManager to them on the calling event loop. Shared by `weft.Engine` and `weft serve`."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weft.runtime.config import EngineConfig
from weft.runtime.ipc.channel import Endpoints
from weft.runtime.ipc.child import ChildProcess
from weft.runtime.ipc.messages import ReadyOut
from weft.runtime.loader import read_hf_config, resolve_model_path
from weft.runtime.loader.model_info import ModelInfo
from weft.runtime.loader.tokenizer_source import TokenizerSource, resolve_tokenizer
from weft.runtime.models.parallel import check_tp
from weft.runtime.server.limits import RequestLimits
from weft.runtime.server.tokenizer_manager import RuntimeDown, TokenizerManager

logger = logging.getLogger(__name__)


class ChildProcesses:
    """The scheduler (one process per tensor-parallel rank) and the detokenizer of one runtime;
    any death takes the others down. Each resolves the runtime's tokenizer from the model path
    (`resolve_tokenizer`), as the front did."""

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.ends, self.ipc_dir = Endpoints.in_private_dir()
        self.procs = {
            "scheduler": ChildProcess("scheduler", config, str(model_path), self.ends),
        }
        for rank in range(1, config.tp_size):
            self.procs[f"scheduler rank {rank}"] = ChildProcess(
                "scheduler", config, str(model_path), self.ends, tp_rank=rank
            )
        self.procs["detokenizer"] = ChildProcess("detokenizer", config, str(model_path), self.ends)
        self.closed = False

    def start(self) -> None:
        for proc in self.procs.values():
            proc.start()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.pid is not None]

    def check(self) -> str | None:
        """None while all live; else which died and how (and the rest are told to stop). When
        several are gone by now, those killed by a signal come first: the others most likely
        failed because of them (a rank whose peer vanished)."""
        if self.closed:
            return None
        dead = [
            (name, proc.exitcode)
            for name, proc in self.procs.items()
            if proc.pid is not None and not proc.is_alive()
        ]
        if not dead:
            return None
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        dead.sort(key=lambda d: not (d[1] is not None and d[1] < 0))  # stable: signals first
        said = "; ".join(f"the {name} process exited with code {code}" for name, code in dead)
        return f"{said} (see {'its log' if len(dead) == 1 else 'their logs'} above)"

    def shutdown(self, grace: float = 5.0) -> None:
        """Terminate, then kill what is left after `grace` seconds; remove the ipc directory."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            if proc.pid is not None:
                proc.join(grace)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@dataclass
class Runtime:
    """A started runtime: its children, its tokenizer manager, and what they reported."""

    config: EngineConfig
    model_path: Path
    info: ModelInfo
    tokenizer: Any  # None with skip_tokenizer_init
    tokenizer_source: TokenizerSource
    children: ChildProcesses
    manager: TokenizerManager
    server_info: dict[str, Any]

    async def close(self) -> None:
        self.children.shutdown()
        await self.manager.close()


@dataclass(frozen=True)
class Prepared:
    """What the front works out before any process starts."""

    model_path: Path  # converted if needed
    info: ModelInfo
    tokenizer_source: TokenizerSource
    tokenizer: Any  # None with skip_tokenizer_init


def prepare(config: EngineConfig) -> Prepared:
    """The model folder, its facts and its tokenizer; the children resolve the same tokenizer
    (a synthetic one is built here, so they find it cached)."""
    model_path = resolve_model_path(
        config.model,
        config.resolved_cache_dir,
        need_weights=config.load_format != "dummy",
        gguf_weights=config.resolved_quantization != "gguf",
    )
    hf_config = read_hf_config(model_path)
    check_tp(hf_config, config.tp_size)  # before any process starts
    info = ModelInfo.from_folder(model_path, hf_config, config)
    source = resolve_tokenizer(config, model_path)
    if source.kind == "synthetic":
        logger.warning("tokenizer: %s (cached in %s)", source.description, source.path)
    elif source.kind == "none":
        logger.info("tokenizer: %s", source.description)
    return Prepared(model_path, info, source, source.load())


async def start_runtime(config: EngineConfig, limits: RequestLimits | None = None) -> Runtime:
    """Everything up to "ready", on the running event loop; raises with the reason on failure.
    `limits`: the caps on each request (none by default: the offline Engine)."""
    prep = prepare(config)
    model_path, info, tokenizer = prep.model_path, prep.info, prep.tokenizer
    children = ChildProcesses(config, model_path)
    manager = TokenizerManager(
        tokenizer,
        info,
        max_total_tokens=0,  # known once the scheduler reports its pool
        scheduler_addr=children.ends.scheduler,
        listen_addr=children.ends.engine,
        check_children=children.check,
        limits=limits,
        lora_adapters=config.lora_adapters,
    )
    manager.start()
    try:
        children.start()
        server_info = await _wait_ready(manager)
    except BaseException:
        children.shutdown()
        await manager.close()
        raise
    manager.max_total_tokens = int(server_info["max_total_tokens"])
    server_info["tokenizer_source"] = prep.tokenizer_source.to_dict()
    return Runtime(
        config, model_path, info, tokenizer, prep.tokenizer_source, children, manager, server_info
    )


async def _wait_ready(manager: TokenizerManager) -> dict[str, Any]:
    pending = {"scheduler", "detokenizer"}
    info: dict[str, Any] = {}
    while pending:
        msg = await manager.control.get()
        if manager.down is not None:
            raise RuntimeDown(f"weft failed to start: {manager.down}")
        if not isinstance(msg, ReadyOut):
            continue
        if msg.error is not None:
            raise RuntimeError(f"weft {msg.who} failed to start: {msg.error}")
        logger.info("%s ready %s", msg.who, msg.info or "")
        pending.discard(msg.who)
        info.update(msg.info)
    return info
