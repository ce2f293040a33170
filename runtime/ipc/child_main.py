"""Entry point of a runtime child process: read the launch payload from stdin and run the role."""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from weft.runtime.config import EngineConfig
from weft.runtime.ipc.channel import Endpoints


def main() -> None:
    payload: dict[str, Any] = msgspec.json.decode(sys.stdin.buffer.read())
    config = EngineConfig.from_dict(payload["config"])
    ends = Endpoints(**payload["ends"])
    if payload["role"] == "scheduler":
        from weft.runtime.scheduler.process import run_scheduler_process

        run_scheduler_process(
            config, payload["path"], ends, payload["parent"], int(payload.get("tp_rank", 0))
        )
    else:
        from weft.runtime.server.detokenizer import run_detokenizer_process

        run_detokenizer_process(config, payload["path"], ends, payload["parent"])


if __name__ == "__main__":
    main()
