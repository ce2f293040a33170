"""Reading a GGUF file's header: metadata values and the tensor table, checked against the file."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

# NOTE: gguf.GGUFReader builds a numpy view per vocabulary and merge string (~150k for SmolLM2),
# which costs ~4.6 s before any tensor is read. The header is simple enough to walk ourselves;
# tensor data is still decoded by gguf.quants.dequantize.

_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4


class CorruptGGUFError(ValueError):
    """The file is not a complete, well-formed GGUF file (truncated, damaged, or not GGUF)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the last dimension is GGUF's fastest-moving ne0
    qtype: GGMLQuantizationType
    offset: int  # absolute offset of the tensor's bytes in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (along the last dimension) in the file's encoding."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.shape[-1] // block_size * type_size

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    metadata: dict[str, Any]  # string arrays (vocabulary, merges) are kept only as their length
    tensors: tuple[TensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_value(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value such as `attention.head_count` (`llama.attention...`)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse the header of `path`; any inconsistency raises CorruptGGUFError naming the file."""
    size = path.stat().st_size
    if size < 24:
        raise CorruptGGUFError(f"{path} is not a GGUF file: only {size} bytes")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(path, buf, size)
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise CorruptGGUFError(
                f"{path} is truncated or damaged: header unreadable ({e})"
            ) from e


##### Internal Helper Functions #####


def _parse(path: Path, buf: mmap.mmap, size: int) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise CorruptGGUFError(f"{path} is not a GGUF file: it does not start with b'GGUF'")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise CorruptGGUFError(f"{path} has GGUF version {version}; supported: 2 and 3")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key, pos = _read_str(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, vtype)
    if "general.architecture" not in metadata:
        raise CorruptGGUFError(f"{path} has no general.architecture in its metadata")

    table = []
    for _ in range(tensor_count):
        name, pos = _read_str(buf, pos)
        (ndims,) = struct.unpack_from("<I", buf, pos)
        if not 1 <= ndims <= _MAX_DIMS:
            raise CorruptGGUFError(f"{path}: tensor {name!r} claims {ndims} dimensions")
        dims = struct.unpack_from(f"<{ndims}Q", buf, pos + 4)
        qtype_id, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndims)
        pos += 4 + 8 * ndims + 12
        table.append((name, tuple(reversed(dims)), qtype_id, offset))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    tensors = tuple(_tensor_info(path, size, data_start, *entry) for entry in table)
    return GGUFHeader(path=path, metadata=metadata, tensors=tensors)


def _tensor_info(
    path: Path,
    size: int,
    data_start: int,
    name: str,
    shape: tuple[int, ...],
    qtype_id: int,
    off: int,
) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(qtype_id)
    except ValueError:
        raise CorruptGGUFError(
            f"{path}: tensor {name!r} has unknown ggml type {qtype_id}"
        ) from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise CorruptGGUFError(f"{path}: tensor {name!r} row {shape[-1]} is not whole blocks")
    offset, nbytes = data_start + off, math.prod(shape) // block_size * type_size
    if offset + nbytes > size:
        raise CorruptGGUFError(
            f"{path} is truncated: tensor {name!r} ends at byte {offset + nbytes:,} "
            f"but the file has {size:,} bytes"
        )
    return TensorInfo(name=name, shape=shape, qtype=qtype, offset=offset, nbytes=nbytes)


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise struct.error(f"string of {n} bytes at {pos} runs past the end")
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == GGUFValueType.STRING:
        return _read_str(buf, pos)
    if vtype != GGUFValueType.ARRAY:
        raise struct.error(f"unknown metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:
        fmt = _SCALARS[etype]
        width = struct.calcsize(fmt)
        if pos + count * width > len(buf):
            raise struct.error(f"array of {count} values at {pos} runs past the end")
        return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + count * width
    if etype != GGUFValueType.STRING:
        raise struct.error(f"unsupported metadata array element type {etype}")
    for _ in range(count):  # vocabularies and merges: only walked, the tokenizer reads them
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
    return count, pos
