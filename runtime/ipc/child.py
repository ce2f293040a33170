"""Child processes of a runtime, started as `python -m weft.runtime.ipc.child_main` (never by re-running
the user's __main__, as multiprocessing's spawn would): the launch payload arrives on stdin."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from typing import Literal

import msgspec

from weft.runtime.config import EngineConfig
from weft.runtime.ipc.channel import Endpoints

Role = Literal["scheduler", "detokenizer"]


class ChildProcess:
    """One child: a subprocess.Popen with the few process verbs the runtime uses."""

    def __init__(
        self, role: Role, config: EngineConfig, path: str, ends: Endpoints, tp_rank: int = 0
    ) -> None:
        self.role = role
        payload = {
            "role": role,
            "config": config.to_dict(),
            "path": path,
            "ends": asdict(ends),
            "parent": os.getpid(),
            "tp_rank": tp_rank,
        }
        self._payload = msgspec.json.encode(payload)
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "weft.runtime.ipc.child_main"],
            stdin=subprocess.PIPE,
            close_fds=True,
        )
        assert self._popen.stdin is not None
        self._popen.stdin.write(self._payload)
        self._popen.stdin.close()

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            assert self._popen is not None
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
