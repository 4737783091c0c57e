"""Rotary embedding (neox style) of q and k in one launch, from the float32 cos/sin table.

`rotary_embedding(positions (T,), q (T, Hq, D), k (T, Hkv, D) | None, cos_sin_cache (P, D))`
-> (q', k'): with [cos | sin] = cache[pos] and x = [x1 | x2] (halves of each head),
x' = [x1 cos - x2 sin | x2 cos + x1 sin] in float32, cast back to x's dtype (layers/rotary.py).
Scaled RoPE variants (linear, llama3, yarn) live in the table. In place by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2


@triton.jit
def _rotate_heads(x_ptr, o_ptr, stride_h, stride_oh, num_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, HALF)[None, :]
    mask = h < num_heads
    x1 = tl.load(x_ptr + h * stride_h + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + h * stride_h + HALF + i, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(o_ptr + h * stride_oh + i, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + h * stride_oh + HALF + i, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, cache_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, num_q_heads, num_k_heads,
    stride_cache, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HAS_K: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i)  # (1, HALF) float32
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i)
    _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh,
                  num_q_heads, cos, sin, HALF, BLOCK_HQ)
    if HAS_K:
        _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh,
                      num_k_heads, cos, sin, HALF, BLOCK_HK)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    *,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotates q (T, Hq, D) and k (T, Hkv, D) (strided views of a packed qkv are fine) at
    `positions` (T,) int64/int32. Returns (q, k), the inputs themselves when inplace."""
    check(q.dim() == 3, "q must be (T, Hq, D)")
    num_tokens, num_q_heads, head_dim = q.shape
    check(q.dtype in FLOAT_DTYPES, f"unsupported dtype {q.dtype}")
    check(head_dim % 2 == 0 and next_pow2(head_dim // 2) == head_dim // 2,
          "head_dim must be a power of two")
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim,
          "cos_sin_cache must be (P, D) (partial rotary is not supported)")
    check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache must be float32 with a contiguous last dim")
    check(positions.shape == (num_tokens,) and positions.is_contiguous(), "positions (T,)")
    check(positions.dtype in (torch.int64, torch.int32), "positions must be int64/int32")
    check(q.stride(2) == 1, "q needs a contiguous last dim")
    tensors = [positions, q, cos_sin_cache]
    if k is not None:
        check(k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, "k shape")
        check(k.dtype == q.dtype and k.stride(2) == 1, "k dtype or last-dim stride")
        tensors.append(k)
    check(len({t.device for t in tensors}) == 1, "all inputs must be on one device")
    q_out = q if inplace else torch.empty_like(q)
    k_out = k if inplace or k is None else torch.empty_like(k)
    if num_tokens == 0:
        return q_out, k_out
    k_arg, ko_arg = (k, k_out) if k is not None else (q, q_out)  # unused when HAS_K is False
    _rotary_kernel[(num_tokens,)](
        positions, cos_sin_cache, q, k_arg, q_out, ko_arg, num_q_heads, k_arg.shape[1],
        cos_sin_cache.stride(0), q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1),
        q_out.stride(0), q_out.stride(1), ko_arg.stride(0), ko_arg.stride(1),
        HALF=head_dim // 2, BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(k_arg.shape[1]),
        HAS_K=k is not None, num_warps=4 if num_q_heads * head_dim >= 2048 else 2,
    )
    return q_out, k_out


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out of place, as layers/rotary.py: apply_rotary(x, *cache[positions].chunk(2, -1))."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # (T, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k) if k is not None else None
