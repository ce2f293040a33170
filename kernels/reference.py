"""Pure-PyTorch float32 references for every kernel in weft.kernels (the semantics they must match)."""

from __future__ import annotations

import torch

from .common import FP8_KV, FP8_MAX


def decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [max_reqs, max_context] int
    req_rows: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B]
    scale: float,
    window: int | None = None,
    slot_map: torch.Tensor | None = None,  # [num_full_slots]: req_to_token's slots -> pool rows
) -> torch.Tensor:  # [B, H, D] float32
    """Each request's one query (its newest token) attends to all of its seq_len keys (with a
    `window`, to its last min(window, seq_len) keys; with a `slot_map`, key j is at pool row
    slot_map[req_to_token[row, j]])."""
    if slot_map is not None:
        req_to_token = slot_map[req_to_token.long()]
    # a decode step is an extend of one token whose K/V already sit in the pool at position seq_len-1
    rows, lens = req_rows.long(), seq_lens.long()
    last = req_to_token[rows, lens - 1].long()  # [B] slot of each request's newest token
    ones = torch.ones_like(lens)
    starts = torch.arange(q.shape[0], device=q.device)
    new_k, new_v = k_buffer[last], v_buffer[last]  # [B, Hkv, D]
    pool = (k_buffer, v_buffer, req_to_token, rows)
    return extend_attention_ref(q, new_k, new_v, *pool, lens - 1, ones, starts, scale, window)


def extend_attention_ref(
    q: torch.Tensor,  # [T, H, D] new tokens' queries, request after request
    k: torch.Tensor,  # [T, Hkv, D] new tokens' keys
    v: torch.Tensor,  # [T, Hkv, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D] the pool (holds each request's prefix)
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [max_reqs, max_context]
    req_rows: torch.Tensor,  # [B]
    prefix_lens: torch.Tensor,  # [B] cached tokens before this step
    extend_lens: torch.Tensor,  # [B] new tokens this step
    extend_start_loc: torch.Tensor,  # [B] first row of each request in q/k/v
    scale: float,
    window: int | None = None,
    slot_map: torch.Tensor | None = None,  # [num_full_slots]: req_to_token's slots -> pool rows
) -> torch.Tensor:  # [T, H, D] float32
    """New query i of request b (position prefix+i) sees prefix keys and new keys 0..i; with a
    sliding `window` (>= 1) only those at positions > prefix + i - window (HF's convention: the
    last `window` positions, itself included). Over an fp8 pool the new keys and values are the
    pool's, at the slots after the prefix (stored there by the caller, quantized), not k and v.
    A `slot_map` sends each slot read from req_to_token to the pool's row slot_map[slot]."""
    if slot_map is not None:
        req_to_token = slot_map[req_to_token.long()]
    assert window is None or window >= 1, f"window must be None or >= 1, got {window}"
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[1]
    from_pool = k_buffer.dtype == FP8_KV
    for b in range(req_rows.shape[0]):
        row, pre = int(req_rows[b]), int(prefix_lens[b])
        ext, start = int(extend_lens[b]), int(extend_start_loc[b])
        if ext == 0:
            continue
        new = slice(start, start + ext)
        if from_pool:
            slots = req_to_token[row, : pre + ext].long()  # [pre+ext]
            keys, vals = k_buffer[slots].float(), v_buffer[slots].float()  # [pre+ext, Hkv, D]
        else:
            slots = req_to_token[row, :pre].long()  # [pre]
            keys = torch.cat((k_buffer[slots].float(), k[new].float()))  # [pre+ext, Hkv, D]
            vals = torch.cat((v_buffer[slots].float(), v[new].float()))
        keys = keys.repeat_interleave(group, dim=1)  # [pre+ext, H, D]; q head h uses kv head h//G
        vals = vals.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[new].float(), keys) * scale  # [H, ext, pre+ext]
        q_pos = pre + torch.arange(ext, device=q.device)
        k_pos = torch.arange(pre + ext, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [ext, pre+ext]
        if window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        s = s.masked_fill(hidden[None], float("-inf"))
        out[new] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals)
    return out


def store_kv_ref(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,
    loc: torch.Tensor,  # [T] slots
) -> None:
    """In place: k_buffer[loc] = k, v_buffer[loc] = v (cast to the pool's dtype; an fp8 pool
    saturates at +-448)."""
    if k_buffer.dtype == FP8_KV:
        k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
    k_buffer[loc.long()] = k.to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, N]; weight: [N] -> [T, N] float32
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) in float32: the kernel's (new x, new residual)."""
    h = x.float() + residual.float()  # [T, N]
    return rmsnorm_ref(h, weight, eps), h


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2I] -> [T, I] float32
    gate, up = gate_up.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False
) -> torch.Tensor:
    # x: [M, K] (or [M, 2K] gate | up, with silu_mul: the activation rounded to x's dtype as
    # silu_and_mul stores it); weight: [N, K] -> [M, N] float32
    if silu_mul:
        x = silu_and_mul_ref(x).to(x.dtype)
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [P, R]: cos of R/2 frequencies, then their sin
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k) in float32; dims at or past R are left as they are."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, R/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clone()
        part = x[..., :rot]
        if is_neox:  # halves: (x[i], x[i + R/2])
            x1, x2 = part[..., : rot // 2], part[..., rot // 2 :]
            x[..., :rot] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # GPT-J: interleaved pairs (x[2i], x[2i+1])
            x1, x2 = part[..., 0::2], part[..., 1::2]
            x[..., :rot] = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
        return x

    return rotate(q), rotate(k)


def apply_token_bitmask_ref(
    logits: torch.Tensor,  # [B, V]
    bitmask: torch.Tensor,  # [R, W] int32; bit i of word w allows token 32*w + i
    rows: torch.Tensor | None = None,  # [R] logit row of each mask row; None: R == B
) -> torch.Tensor:  # [B, V], logits' dtype
    """Disallowed tokens -> -inf; tokens at or past 32*W are disallowed; other rows untouched."""
    out = logits.clone()
    (r, width), vocab = bitmask.shape, logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(r, 32 * width).bool()  # [R, 32W]
    allowed = torch.zeros(r, vocab, dtype=torch.bool, device=logits.device)  # [R, V]
    n = min(vocab, 32 * width)
    allowed[:, :n] = bits[:, :n].to(logits.device)
    idx = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows.long()
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def kv_page_indices_ref(
    req_to_token: torch.Tensor, req_rows: torch.Tensor, num_pages: list[int], page_size: int
) -> torch.Tensor:
    """int32 [sum(num_pages)]: for each request b, the pages of its positions 0, P, 2P, ..."""
    parts = [
        req_to_token[int(r), : n * page_size : page_size] // page_size
        for r, n in zip(req_rows.tolist(), num_pages, strict=True)
    ]
    return torch.cat(parts).to(torch.int32) if parts else torch.zeros(0, dtype=torch.int32)
