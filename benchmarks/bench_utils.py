"""Shared benchmark helpers: the copy-bandwidth ceiling, device names, dummy-model folders, engine
arguments, tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from weft.runtime.loader.synthetic_tokenizer import has_tokenizer, synthetic_tokenizer

##### Ceilings and devices #####


class Stopwatch:
    """Seconds between start() and stop(): CUDA events on a GPU (stop() waits for the device), the
    host's clock on CPU."""

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._t0 = 0.0
        self._start: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return float(self._start.elapsed_time(end)) / 1e3


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10, device: str = "cuda") -> float:
    """Device-to-device copy: bytes read + written per second (the memory ceiling); the median
    of `reps` copies after 3 to warm up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    watch, times = Stopwatch(device), []
    for _ in range(reps):
        watch.start()
        dst.copy_(src)
        times.append(watch.stop())
    return 2 * nbytes / statistics.median(times)


def local_copy_bandwidth() -> float:
    """The copy ceiling of this machine's device: 2 GiB on a GPU, 256 MiB on CPU."""
    if torch.cuda.is_available():
        return copy_bandwidth()
    return copy_bandwidth(256 << 20, 5, "cpu")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def git_commit() -> str:
    """The checkout's short commit, with '+' when it has uncommitted changes ('unknown' outside
    a git checkout)."""
    repo = str(Path(__file__).resolve().parents[1])

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", repo, *args], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


##### Dummy-weight model folders #####

# A Llama config small enough for smoke runs on CPU (tests, and `--config` of any entry point)
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 600,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def write_config(folder: Path, **over: Any) -> Path:
    """`folder` (created) with TINY_LLAMA's config.json, `over` on top; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **over}))
    return folder


def model_folder(model: str, workdir: Path) -> tuple[Path, str]:
    """A folder the engine can load with load_format="dummy": `model` itself when it has a
    tokenizer, else a copy of its config.json with a synthetic tokenizer. Returns (folder, note)."""
    src = Path(model)
    config = json.loads((src / "config.json").read_text())
    if has_tokenizer(src):
        return src, "the folder's own tokenizer"
    dst = workdir / src.name
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tok = synthetic_tokenizer(int(config["vocab_size"]), config.get("bos_token_id"), eos_ids)
    tok.save_pretrained(dst)
    return (
        dst,
        f"synthetic byte-level tokenizer of {config['vocab_size']} ids (the folder has none)",
    )


##### Engine arguments #####


def parse_kv(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs as engine keyword arguments; values parse as JSON when they can (true, 3,
    0.5), else stay strings. A dotted key sets a field of a nested config: `tuning.gemv=off` ->
    {"tuning": {"gemv": "off"}} (EngineConfig takes `tuning` as a dict of TuningConfig fields)."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = name.strip().split(".")
        into = out
        for part in parents:
            into = into.setdefault(part, {})
            if not isinstance(into, dict):
                raise argparse.ArgumentTypeError(f"{item!r}: {part} is set as a value already")
        into[leaf] = value
    return out


def merge_kwargs(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over`'s entries on top; a nested dict (tuning) merges field by field."""
    out = dict(base)
    for name, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            value = {**out[name], **value}
        out[name] = value
    return out


##### Tables #####


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def markdown_table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [
        "| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows
    ]
    return "\n".join(lines)
