"""The scheduler process's entry point: the tensor-parallel group, the Scheduler, its loop."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from weft.runtime.config import EngineConfig
from weft.runtime.executor.distributed import init_tp_group
from weft.runtime.ipc.channel import Channel, Endpoints, run_child
from weft.runtime.scheduler.scheduler import Scheduler


def run_scheduler_process(
    config: EngineConfig, model_path: str, ends: Endpoints, parent: int, tp_rank: int = 0
) -> None:
    """Entry point of a scheduler child process (tensor-parallel rank `tp_rank`)."""

    def start(channel: Channel | None) -> tuple[Scheduler, dict[str, Any]]:
        t0 = time.perf_counter()
        tp = None
        if config.tp_size > 1:
            tp = init_tp_group(tp_rank, config.tp_size, config.resolved_device, ends.tp_init)
        scheduler = Scheduler(config, Path(model_path), channel, tp)
        info = {
            "max_total_tokens": scheduler.max_total_tokens,
            "page_size": scheduler.runner.page_size,
            "load_seconds": round(time.perf_counter() - t0, 2),
            "pid": os.getpid(),
            "tp_size": config.tp_size,
        }
        return scheduler, info

    if tp_rank == 0:
        peers = {"detokenizer": ends.detokenizer, "engine": ends.engine}
        name, listen = "scheduler", ends.scheduler
    else:
        peers, name, listen = {}, f"scheduler-{tp_rank}", None
    run_child(name, config.log_level, listen, peers, start, lambda s: s.run_forever(parent))
