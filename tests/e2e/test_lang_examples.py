"""Every example runs, as `python examples/NAME.py --url ... --max-tokens 3` from the repo root
would (against the session's server), in one subprocess so the interpreter and torch are imported
once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NAMES = [
    "quickstart",
    "few_shot",
    "select_choices",
    "fork_join",
    "json_extraction",
    "multi_turn_chat",
    "tool_use_agent",
    "run_batch",
]
RUNNER = """
import runpy, sys
url, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, "examples")  # as `python examples/NAME.py` puts it first
for name in names:
    print(f"=== {name}", flush=True)
    sys.argv = [f"examples/{name}.py", "--url", url, "--max-tokens", "3"]
    runpy.run_path(f"examples/{name}.py", run_name="__main__")
"""


def test_every_example_runs(server: Any) -> None:
    assert sorted(NAMES) == sorted(
        p.stem for p in EXAMPLES.glob("*.py") if p.stem != "example_args"
    )
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, server.url, *NAMES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = proc.stdout.split("=== ")[1:]
    assert [s.split("\n", 1)[0] for s in sections] == NAMES
    assert all(s.split("\n", 1)[1].strip() for s in sections), proc.stdout
