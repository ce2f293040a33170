"""Where `weft.kernels` comes from: the top-level kernels/ folder, a namespace portion.

kernels/ has no __init__.py on purpose: with the repo root on sys.path (`python -c`, `python -m
pytest` from a checkout), a top-level `import kernels` then finds the installed `kernels`
distribution that transformers 5.25+ imports, never this folder. A wheel holds the folder as
weft/kernels/, found by the normal import; setuptools' editable finder only resolves packages
with an __init__.py, so for an editable install `weft.kernels` is declared here from the
checkout's folder.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def declare_kernels() -> None:
    """Make `weft.kernels` importable where the import system does not find it by itself."""
    name = "weft.kernels"
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return
    folder = Path(__file__).resolve().parent.parent / "kernels"
    if not folder.is_dir():
        raise ImportError(f"weft.kernels: no {folder} (a broken install of weft?)")
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    sys.modules[name] = importlib.util.module_from_spec(spec)
