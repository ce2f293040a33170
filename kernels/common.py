"""Launch-wrapper guards (shape, dtype, device, unit-stride checks) and the KV dtypes kernels read."""

from __future__ import annotations

import functools

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)  # the activations' dtypes kernels take
FP8_KV = torch.float8_e4m3fn  # an fp8 KV pool: stored saturated at +-FP8_MAX, read back upcast
FP8_MAX = 448.0


def kv_dtypes(q_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The KV pool dtypes attention kernels read with queries of q_dtype."""
    return (q_dtype, FP8_KV)


def check_tensor(
    t: torch.Tensor,
    name: str,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Assert rank, sizes (None = any), dtype, device and a unit stride in the last dim."""
    assert t.dim() == len(shape) and all(
        want is None or want == got for want, got in zip(shape, t.shape, strict=True)
    ), f"{name}: expected shape {shape}, got {tuple(t.shape)}"
    assert dtypes is None or t.dtype in dtypes, f"{name}: dtype {t.dtype} not in {dtypes}"
    assert device is None or t.device == device, f"{name}: on {t.device}, expected {device}"
    assert t.numel() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1, (
        f"{name}: the last dim must have unit stride, got strides {t.stride()}"
    )


@functools.cache  # NOTE: asked at every launch of the kernels that take `pdl`
def supports_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents (griddepcontrol): a CUDA
    GPU of compute capability 9.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
