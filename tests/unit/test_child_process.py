"""A checkout's kernels/ folder never shadows the `kernels` distribution, and the runtime's child
processes start as `python -m weft.runtime.ipc.child_main`."""

from __future__ import annotations

import importlib.metadata
import io
import subprocess
import sys
from pathlib import Path

import pytest

from weft.runtime.config import EngineConfig
from weft.runtime.ipc import child
from weft.runtime.ipc.channel import Endpoints
from weft.runtime.ipc.child import ChildProcess

ROOT = Path(__file__).resolve().parents[2]


def _has_kernels_distribution() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _has_kernels_distribution(), reason="no `kernels` distribution installed")
def test_the_repo_root_on_sys_path_does_not_shadow_the_kernels_distribution() -> None:
    """From the repo root (sys.path[0] is '' for `python -c`), a top-level `import kernels` is
    the distribution transformers 5.25+ imports, and weft.kernels is still the checkout's."""
    probe = "import kernels, weft.kernels.decode as d; print(kernels.__file__); print(d.__file__)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dist_file, ours = proc.stdout.split()
    assert not Path(dist_file).is_relative_to(ROOT / "kernels"), dist_file
    assert Path(ours).name == "decode.py" and "kernels" in Path(ours).parts


def test_children_start_as_child_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler and detokenizer are `python -m weft.runtime.ipc.child_main`, their launch
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
    assert started == [[sys.executable, "-m", "weft.runtime.ipc.child_main"]]
