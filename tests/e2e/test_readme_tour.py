"""The README's Python blocks run as a new user runs them: a fresh interpreter, plain `python`,
the repo root as the working directory (so its kernels/ folder is on sys.path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_block(heading: str) -> str:
    """The first ```python block under the README section `heading`."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python block under '## {heading}'"
    return match.group(1)


@pytest.mark.parametrize("heading", ["A one-minute tour", "Programs (the DSL)"])
def test_the_readme_runs_from_the_repo_root(
    heading: str, default_model_dir: Path, tmp_path: Path
) -> None:
    # the session's converted packaged model stands in for ~/.cache/weft (no second conversion)
    (tmp_path / "weft").symlink_to(default_model_dir.parent, target_is_directory=True)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", readme_block(heading)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip(), "the block printed nothing"
