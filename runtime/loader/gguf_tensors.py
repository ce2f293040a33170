"""GGUF tensors read straight from the file (memmap) for a model that keeps them quantized: raw
blocks for the quant types, float32 for the rest; llama's q/k row permutation undone by rows,
Gemma's norm offset (1 + w) removed from its float norms."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from weft.kernels.gguf import TYPES
from weft.runtime.loader.gguf_header import GGUFHeader, TensorInfo, read_gguf_header
from weft.runtime.loader.gguf_weights import (
    _PERMUTED_ARCHITECTURES,
    _head_counts,
    check_supported,
    hf_name,
    norm_offset,
)

_FLOATS = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


class BlockTensor:
    """One GGUF tensor (a LazyWeight): `shape` in torch order (weights [out, in]), its ggml type,
    and reads of a slice as raw blocks or as float32 (plus `offset`: Gemma's norms, stored as
    1 + w). Its bytes come from `source()` when read (a file's memmap, or blocks in memory for
    dummy weights)."""

    def __init__(self, name: str, shape: tuple[int, ...], ggml_id: int,
                 source: Callable[[], torch.Tensor], device: torch.device,
                 row_perm: torch.Tensor | None = None, offset: float = 0.0) -> None:  # fmt: skip
        self.name = name
        self.shape = shape
        self.ggml_id = ggml_id
        self.qtype = GGMLQuantizationType(ggml_id)
        self.device = device
        self._source = source  # uint8, the tensor's bytes
        self._perm = row_perm  # HF row i is the stored row row_perm[i]
        self.offset = offset  # added to the float values (never to raw blocks)

    @classmethod
    def of_blocks(cls, name: str, shape: tuple[int, ...], ggml_id: int,
                  blocks: torch.Tensor) -> BlockTensor:  # fmt: skip
        """A tensor whose blocks are already in memory (dummy weights)."""
        return cls(name, shape, ggml_id, lambda: blocks, blocks.device)

    @property
    def quantized(self) -> bool:
        """Whether the blocks can stay as they are (a type weft's kernels read)."""
        return self.ggml_id in TYPES

    @property
    def row_bytes(self) -> int:
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block * nbytes

    def read_blocks(self, dim: int, start: int, size: int) -> torch.Tensor:
        """uint8 [rows, bytes] of elements [start, start + size) along dim (-1: all) of a 2-D
        weight; a slice along the rows' length must cover whole blocks."""
        if len(self.shape) != 2 or self.offset:
            raise ValueError(f"{self.name}: only 2-D tensors without an offset are kept as "
                             "blocks")  # fmt: skip
        rows = self.shape[0]
        block, nbytes = GGML_QUANT_SIZES[self.qtype]
        raw = self._source().reshape(rows, self.row_bytes)
        if self._perm is not None:
            raw = raw[self._perm.to(raw.device)]
        if dim == 0:
            raw = raw[start : start + size]
        elif dim == 1:
            if start % block or size % block:
                raise ValueError(f"{self.name}: columns [{start}, {start + size}) do not "
                                 f"fall on its {block}-weight blocks")  # fmt: skip
            raw = raw[:, start // block * nbytes : (start + size) // block * nbytes]
        return raw.contiguous().to(self.device)

    def read(self, dim: int, start: int, size: int) -> torch.Tensor:
        """float32 elements [start, start + size) along dim (-1: the whole tensor)."""
        from weft.kernels.gguf import dequantize

        raw = self._source()
        if self.qtype in _FLOATS:
            full = raw.view(_FLOATS[self.qtype]).reshape(self.shape).float()
        elif self.quantized:
            full = dequantize(raw.reshape(*self.shape[:-1], self.row_bytes), self.ggml_id,
                              self.shape[-1])  # fmt: skip
        else:
            raise ValueError(f"{self.name}: ggml type {self.qtype.name} is not read by weft's "
                             "GGUF kernels; pass dequantize=True")  # fmt: skip
        if self._perm is not None:
            full = full[self._perm.to(full.device)]
        if self.offset:
            full = full + self.offset
        if dim >= 0:
            full = full.narrow(dim, start, size)
        return full.contiguous().to(self.device)


def gguf_tensor_types(header: GGUFHeader) -> dict[str, int]:
    """HF name -> ggml type id of every parameter the file holds."""
    check_supported(header)
    names = ((hf_name(t.name, header.architecture), int(t.qtype)) for t in header.tensors)
    return {name: qtype for name, qtype in names if name is not None}


def iterate_gguf(
    path: Path, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, BlockTensor]]:
    """(HF name, lazy tensor) for every parameter of the GGUF file, in file order."""
    header = read_gguf_header(path)
    check_supported(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    heads = _head_counts(header) if header.architecture in _PERMUTED_ARCHITECTURES else {}
    arch = header.architecture
    for info in header.tensors:
        name = hf_name(info.name, arch)
        if name is None:
            continue
        part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        perm = _rope_rows(info.shape[0], heads[part]) if part in heads else None
        yield name, BlockTensor(info.name, info.shape, int(info.qtype), _reader(data, info),
                                torch.device(device), perm, norm_offset(info.name, arch))  # fmt: skip


def _reader(data: np.memmap, info: TensorInfo) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:  # a copy: one tensor in host memory at a time
        return torch.from_numpy(np.array(data[info.offset : info.offset + info.nbytes]))

    return read


def _rope_rows(rows: int, n_heads: int) -> torch.Tensor:
    """The file row of each HF row of a llama q/k weight (gguf_weights.unpermute_rope, by rows)."""
    index = np.arange(rows)
    half = rows // n_heads // 2
    return torch.from_numpy(index.reshape(n_heads, half, 2).swapaxes(1, 2).reshape(rows).copy())
