"""Shared fixtures: the packaged model's converted folder and a tiny random model built from it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import ServerProcess, save_tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def weft_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private model cache for the session (never the user's ~/.cache/weft)."""
    return tmp_path_factory.mktemp("weft-cache")


@pytest.fixture(scope="session")
def default_model_dir(weft_cache: Path) -> Path:
    """The packaged SmolLM2-135M-Instruct, converted once into the session cache."""
    from weft.runtime.loader import resolve_model_path

    return resolve_model_path(None, weft_cache)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: fast scheduler tests with real text."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_dir)


@pytest.fixture(scope="session")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`weft serve` on the packaged SmolLM2 (one for the whole session), with the cache report."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    args = ["--model", str(default_model_dir), "--served-model-name", "smollm2"]
    proc = ServerProcess([*args, "--enable-cache-report"], log)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
