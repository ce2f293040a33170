"""The runtime's child processes start without the working directory on sys.path (3.11+)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from weft.runtime import child
from weft.runtime.child import ChildProcess, python_command
from weft.runtime.config import EngineConfig
from weft.runtime.ipc import Endpoints

safe_path = pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is Python 3.11+")


@safe_path
def test_a_folder_in_the_working_directory_does_not_shadow_an_import(tmp_path: Path) -> None:
    """A folder named like a dependency's import (a checkout's kernels/ and the `kernels`
    distribution of transformers 5.25+) stays out of the way; a plain interpreter finds it."""
    shadow = tmp_path / "msgspec"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('shadowed by the working directory')\n")
    probe = "import msgspec; print(msgspec.__file__)"
    plain = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert plain.returncode != 0 and "shadowed by the working directory" in plain.stderr
    safe = subprocess.run(python_command("-c", probe), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert safe.returncode == 0, safe.stderr
    assert str(tmp_path) not in safe.stdout


def test_children_start_through_python_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler and detokenizer are `python [-P] -m weft.runtime.child_main`, their launch
    payload on stdin."""
    started: list[list[str]] = []

    class FakePopen:
        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            started.append(cmd)
            self.stdin = io.BytesIO()
            self.stdin.close = lambda: None  # type: ignore[method-assign]

    monkeypatch.setattr(child.subprocess, "Popen", FakePopen)
    ends = Endpoints("ipc:///tmp/a", "ipc:///tmp/b", "ipc:///tmp/c", "/tmp/d")
    ChildProcess("detokenizer", EngineConfig(), "model", ends).start()
    assert started == [python_command("-m", "weft.runtime.child_main")]
    assert started[0][1:2] == (["-P"] if sys.version_info >= (3, 11) else ["-m"])
