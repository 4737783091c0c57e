"""SiLU-and-mul: x = [gate | up] (M, 2I) -> silu(gate) * up (M, I), as layers/activation.py.

Rounding follows torch's eager path: silu in float32 rounded to x's dtype, then the product in
float32 rounded again, so bf16 results match `F.silu(gate) * up` up to the last-ulp of exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, pdl, pdl_sync


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x (M, 2I) -> (M, I) in x's dtype; each program does `block` columns of one row."""
    check(x.dim() == 2 and x.shape[1] % 2 == 0, "x must be (M, 2I)")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    check(x.stride(1) == 1, "x needs a contiguous last dim")
    num_rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    check(out.shape == (num_rows, inter) and out.dtype == x.dtype and out.stride(1) == 1, "out")
    check(out.device == x.device, "x and out on different devices")
    block = block or min(1024, triton.next_power_of_2(inter))
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](
            x,
            out,
            inter,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=num_warps or 4,
            **pdl(x.device),
        )
    return out


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
