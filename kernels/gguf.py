"""GGUF quant blocks in torch: the block layouts, a vectorized dequantizer per type (CPU and GPU,
bit-exact with gguf-py's numpy; no host-to-device copies, so they run inside CUDA graphs),
random valid blocks, and the torch matmul / row lookup."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    """One GGML quant type: `block` weights in `nbytes` bytes (ggml's type id `ggml_id`)."""

    name: str
    ggml_id: int
    block: int
    nbytes: int

    def row_bytes(self, k: int) -> int:
        if k % self.block:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block}; K={k} is not")
        return k // self.block * self.nbytes


TYPES = {
    t.ggml_id: t
    for t in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q5_0", 6, 32, 22),
        BlockType("Q5_1", 7, 32, 24),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_K", 12, 256, 144),
        BlockType("Q5_K", 13, 256, 176),
        BlockType("Q6_K", 14, 256, 210),
    )
}
# rows dequantized at a time by the torch matmul: bounds its float copy (4096 x 8960 fp32: 147 MB)
CHUNK_ROWS = 4096


def block_type(ggml_id: int) -> BlockType:
    if ggml_id not in TYPES:
        names = ", ".join(t.name for t in TYPES.values())
        raise ValueError(f"ggml type {ggml_id} is not kept quantized (supported: {names})")
    return TYPES[ggml_id]


def dequantize(blocks: torch.Tensor, ggml_id: int, k: int) -> torch.Tensor:
    """uint8 rows [..., row_bytes] of type `ggml_id` -> float32 [..., k], the values gguf-py's
    `gguf.quants.dequantize` gives (same float32 operations in the same order)."""
    t = block_type(ggml_id)
    assert blocks.dtype == torch.uint8, blocks.dtype
    lead = blocks.shape[:-1]
    if blocks.shape[-1] != t.row_bytes(k):
        raise ValueError(f"{t.name}: rows of {blocks.shape[-1]} bytes, expected "
                         f"{t.row_bytes(k)} for K={k}")  # fmt: skip
    b = blocks.reshape(-1, t.nbytes)  # [nb, nbytes]
    out = _DEQUANT[t.name](b)  # [nb, block]
    return out.reshape(*lead, k)


def linear(
    x: torch.Tensor, blocks: torch.Tensor, ggml_id: int, bias: torch.Tensor | None = None,
    chunk_rows: int = CHUNK_ROWS,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ W^T (+ bias) for W [N, K] held as `blocks` [N, row_bytes]: dequantized
    `chunk_rows` rows at a time (never the whole weight in full precision), in x's dtype."""
    n = blocks.shape[0]
    k = x.shape[-1]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, chunk_rows):
        w = dequantize(blocks[start : start + chunk_rows], ggml_id, k).to(x.dtype)
        torch.matmul(x, w.t(), out=out[:, start : start + w.shape[0]])
    if bias is not None:
        out += bias
    return out


def embedding(ids: torch.Tensor, blocks: torch.Tensor, ggml_id: int, k: int,
              dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Rows `ids` [T] of W [V, k] held as `blocks` [V, row_bytes]: [T, k] in `dtype`."""
    return dequantize(blocks[ids], ggml_id, k).to(dtype)


def random_blocks(ggml_id: int, rows: int, k: int, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu", scale: float = 0.02) -> torch.Tensor:  # fmt: skip
    """Random valid blocks [rows, row_bytes] of W [rows, k] on `device` (the generator's):
    random quants and sub-scales, the float16 scales (d, dmin, m) finite, with weights of
    magnitude about `scale`."""
    t = block_type(ggml_id)
    nb = rows * (k // t.block)
    raw = torch.randint(0, 256, (nb, t.nbytes), generator=generator, dtype=torch.uint8,
                        device=device)  # fmt: skip

    def f16(lo: float, hi: float) -> torch.Tensor:  # [nb, 2] bytes of float16 in [lo, hi)
        v = torch.rand(nb, 1, generator=generator, device=device) * (hi - lo) + lo
        return v.to(torch.float16).view(torch.uint8)

    unit = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 127}.get(t.name)
    if unit is not None:  # legacy: d first; the _1 types' m next (min of the block: -8 d..0)
        raw[:, 0:2] = f16(0.5 * scale / unit, 1.5 * scale / unit)
        if t.name in ("Q4_1", "Q5_1"):
            raw[:, 2:4] = f16(-scale, 0.0)
    elif t.name in ("Q4_K", "Q5_K"):  # d, dmin, then 6-bit scales / mins up to 63
        levels = 15 if t.name == "Q4_K" else 31
        raw[:, 0:2] = f16(0.5 * scale / levels / 32, 1.5 * scale / levels / 32)
        raw[:, 2:4] = f16(0.0, scale / 63)
    else:  # Q6_K: int8 scales at 192..207, d last
        raw[:, 208:210] = f16(0.5 * scale / 32 / 64, 1.5 * scale / 32 / 64)
    return raw.reshape(rows, t.row_bytes(k))


##### Dequantizers: [nb, nbytes] uint8 -> [nb, block] float32 #####


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block, as float32 [nb, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 16] bytes -> [nb, 32]: the 16 low nibbles, then the 16 high ones (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits5(qh: torch.Tensor) -> torch.Tensor:
    """[nb, 4] bytes of a little-endian uint32 -> [nb, 32] bit i of it, as uint8."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:22]) | (_bits5(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]) | (_bits5(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K block: [nb, 12] bytes -> 2 x [nb, 8]."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k4_quants(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 128] bytes -> [nb, 8, 32]: per 32 bytes, the low nibbles then the high ones."""
    q = qs.reshape(-1, 4, 32)
    return torch.stack((q & 0x0F, q >> 4), dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[:, :, None]
    dm = (_f16(b, 2) * mn.float())[:, :, None]
    return (d * _k4_quants(b[:, 16:144]).float() - dm).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[:, :, None]
    dm = (_f16(b, 2) * mn.float())[:, :, None]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    high = (b[:, None, 16:48] >> shifts) & 1  # [nb, 8, 32]: bit s of qh[l]
    q = _k4_quants(b[:, 48:176]) | (high << 4)
    return (d * q.float() - dm).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 64)
    ql = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 32)
    qh = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(nb, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales)[:, :, None]  # [nb, 16, 1]
    return (d * q.reshape(nb, 16, 16).float()).reshape(nb, 256)


_DEQUANT = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
