"""RMSNorm with optional fused residual add, numerically as layers/norm.py (HF's cast order).

`rms_norm(x, weight, eps)` -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) with the norm in
float32; `rms_norm(x, weight, eps, residual)` -> (norm(s), s) with s = x + residual rounded to
x's dtype first (HF adds in the model dtype). x is (M, N) or (T, H, N) (Qwen3 q/k norm per head,
strided views welcome); outputs may alias the inputs (each row is read before it is written).
x may also be a split-K product not yet summed (`gemv.SplitSum`), with a residual: the kernel
sums it as the reduce kernel would, so a decoder layer's o / down projections skip that kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2, pdl, pdl_sync
from .gemv import SplitSum, split_sum


@triton.jit(do_not_specialize=["num_rows"])  # any count, one variant (as gemv.py's M)
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, b_ptr, num_rows, num_heads, N, eps, split_stride,
    stride_x0, stride_x1, stride_r0, stride_r1, stride_o0, stride_o1, stride_ro0, stride_ro1,
    HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUND_LAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    """SPLITS > 0: x is a split-K product's float32 partials (SPLITS x num_rows x N, split_stride
    apart) and its bias, summed and rounded to the residual's dtype before the add."""
    pdl_sync(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = (rows // num_heads)[:, None]  # row -> (token, head) of a (T, H, N) view
    h = (rows % num_heads)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows[:, None] < num_rows) & (cols < N)
    x_ptrs = x_ptr + t * stride_x0 + h * stride_x1 + cols
    if SPLITS > 0:
        x = split_sum(x_ptrs, split_stride, mask, b_ptr, cols, SPLITS, HAS_BIAS)
        x = x.to(r_ptr.dtype.element_ty)  # the projection's output, as the reduce kernel rounds it
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + t * stride_r0 + h * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # HF: add in dtype
        tl.store(rout_ptr + t * stride_ro0 + h * stride_ro1 + cols, x, mask=mask)
    if ROUND_LAST:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)[:, None]
        y = xf * rstd * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    else:
        y = normed_rows(x, w_ptr, cols, N, eps)
    tl.store(out_ptr + t * stride_o0 + h * stride_o1 + cols, y.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def normed_rows(x, w_ptr, cols, N, eps):
    """weight * norm(x) in float32 for (BLOCK_M, BLOCK_N) rows x (masked columns hold 0; `cols`
    (1, BLOCK_N)), rounded to x's dtype before the weight multiplies, as HF does."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)[:, None]
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    return normed.to(tl.float32) * w.to(tl.float32)


def _rows(t: torch.Tensor) -> tuple[int, int]:
    """Strides of a (T, H, N) view of t without making the view (~1 us of host time each): a
    2-D tensor is one head per row."""
    s = t.stride()
    return (s[0], s[1]) if len(s) == 3 else (s[0], 0)


def rms_norm(
    x: torch.Tensor | SplitSum,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    round_last: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (M, N) or (T, H, N) -> normed (same shape, dtype promote(weight, x)); with `residual`
    also returns x + residual (in x's dtype). Pass residual_out=residual to update it in place.
    `round_last`: the weight multiplies in float32 and the product is rounded once, to x's dtype
    (the zero-centred norms' order, layers/zero_centred_norm.py).
    A `SplitSum` x (M, N) needs a residual: x is its sum. `block_m` rows share a program (short
    rows), spread over `num_warps`."""
    splits, bias, dtype = 0, None, x.dtype
    if isinstance(x, SplitSum):
        check(residual is not None, "a SplitSum is normed with a residual")
        check(x.partials.dtype == torch.float32 and x.partials.is_contiguous(),
              "SplitSum partials: (S, M, N) float32, contiguous")
        splits, bias, x = x.partials.shape[0], x.bias, x.partials[0]  # x: split 0, (M, N)
    check(x.dim() in (2, 3), "x must be (M, N) or (T, H, N)")
    shape, device = x.shape, x.device
    n = shape[-1]
    check(dtype in FLOAT_DTYPES, "unsupported dtype", dtype)
    check(weight.shape == (n,) and weight.is_contiguous(), "weight must be (N,) contiguous")
    check(x.stride(-1) == 1, "x needs a contiguous last dim")
    check(n <= 32768, "rows longer than 32768 are not supported")
    promoted = torch.promote_types(weight.dtype, dtype)
    out_dtype = dtype if weight.dtype == dtype or round_last else promoted
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    check(out.shape == shape and out.dtype == out_dtype and out.stride(-1) == 1, "bad out")
    check(weight.device == device and out.device == device, "all inputs must be on one device")
    r, ro = x, out  # the kernel's residual pointers, unused without one
    if residual is not None:
        check(residual.shape == shape and residual.dtype == dtype, "residual != x shape/dtype")
        if residual_out is None:
            residual_out = torch.empty(shape, dtype=dtype, device=device)
        check(residual_out.shape == shape and residual_out.dtype == dtype, "bad residual_out")
        check(residual.stride(-1) == 1 and residual_out.stride(-1) == 1, "residual last dim")
        check(residual.device == device and residual_out.device == device,
              "all inputs must be on one device")
        r, ro = residual, residual_out
    if bias is not None:
        check(bias.shape == (n,) and bias.is_contiguous(), "SplitSum bias must be (N,)")
    num_heads = shape[1] if len(shape) == 3 else 1
    num_rows = shape[0] * num_heads
    block_n = next_pow2(n)
    block_m = block_m or 1  # several rows a program are no faster, even at N=1024
    if num_rows:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
            x, r, weight, out, ro, bias if bias is not None else weight, num_rows, num_heads, n,
            eps, num_rows * n, *_rows(x), *_rows(r), *_rows(out), *_rows(ro),
            HAS_RESIDUAL=residual is not None, SPLITS=splits, HAS_BIAS=bias is not None,
            ROUND_LAST=round_last, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps or max(1, min(16, block_m * block_n // 256)), **pdl(device),
        )
    if residual is None:
        return out
    return out, residual_out


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers/norm.py's RMSNorm.forward, verbatim in math."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)
