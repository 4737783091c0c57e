"""Gated RMSNorm (Qwen3.5 / Qwen3-Next linear attention's output norm) in one kernel.

`gated_rms_norm(x, gate, weight, eps)` -> (weight * norm(x).to(x.dtype)) * silu(gate), the norm
and the gate in float32, rounded to x's dtype at the end: HF's Qwen3_5RMSNormGated, whose eager
form is eight torch ops (a decode step of the 0.8B shape runs it in 18 layers). x and gate are
(T, H, N) with a contiguous last dim (gate may be a strided view of the input projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2, pdl, pdl_sync
from .rms_norm import normed_rows


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, num_rows, num_heads, N, eps,
    stride_x0, stride_x1, stride_g0, stride_g1, stride_o0, stride_o1,
    ROUND_WEIGHTED: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    t, h = row // num_heads, row % num_heads
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x0 + h * stride_x1 + cols, mask=mask, other=0.0)
    y = normed_rows(x, w_ptr, cols, N, eps)  # weight * norm(x), float32
    if ROUND_WEIGHTED:  # torch multiplies weight and norm in their common 16-bit dtype
        y = y.to(x.dtype).to(tl.float32)
    g = tl.load(g_ptr + t * stride_g0 + h * stride_g1 + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (g * tl.sigmoid(g))
    tl.store(out_ptr + t * stride_o0 + h * stride_o1 + cols, y.to(out_ptr.dtype.element_ty),
             mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, gate (T, H, N) -> (T, H, N) in x's dtype, contiguous."""
    check(x.dim() == 3 and gate.shape == x.shape, "x and gate must be (T, H, N)")
    check(x.dtype in FLOAT_DTYPES and gate.dtype == x.dtype, "x and gate: one float dtype")
    check(x.stride(-1) == 1 and gate.stride(-1) == 1, "x and gate need a contiguous last dim")
    T, H, N = x.shape
    check(weight.shape == (N,) and weight.is_contiguous(), "weight must be (N,) contiguous")
    check(x.device == gate.device == weight.device, "all inputs must be on one device")
    out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
    if T * H:
        _gated_rms_norm_kernel[(T * H,)](
            x, gate, weight, out, T * H, H, N, eps,
            x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), out.stride(0), out.stride(1),
            ROUND_WEIGHTED=x.dtype != torch.float32 and weight.dtype == x.dtype,
            BLOCK_N=next_pow2(N), num_warps=max(1, min(8, next_pow2(N) // 256)),
            **pdl(x.device),
        )
    return out


def gated_rms_norm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """HF's Qwen3_5RMSNormGated (the CPU path of layers/gated_deltanet.py's GatedRMSNorm)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * torch.nn.functional.silu(gate.float())).to(x.dtype)
