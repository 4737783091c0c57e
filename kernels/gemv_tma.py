"""The "tma" gemv method (Hopper): the dot kernel's swap-AB product, y^T tile = W tile @ x^T, with
W and x fetched through tensor descriptors (the copy engine, zero-filled past the edges) instead
of per-thread pointer loads. `gemv` launches it; `gemv_config.tma_config` picks its tiles.

Used for a 7-8B gate_up at 33-64 rows (`gemv_config._tma_pays`): with the SiLU epilogue it is
slower than the dot kernel alone, yet its steps are 2% faster (docs/benchmark-log.md). At
attention out and down, and at 128 rows, cuBLAS or split-K win.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import (
    check,
    dot_precision,
    is_interpreter,
    next_pow2,
    pdl,
    pdl_sync,
    silu_mul_rounded,
)


@triton.jit(do_not_specialize=["M"])  # as the dot kernel: eager steps take any row count
def _gemv_tma_kernel(
    w_desc, x_desc, y_ptr, b_ptr, M, N, K, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program i writes y columns [i BLOCK_N, (i + 1) BLOCK_N). SILU_MUL: W is [gate; up] (2N x K),
    so the program streams those gate rows and the same up rows, and y = silu(gate) * up."""
    pdl_sync(USE_PDL)
    lo = tl.program_id(0) * BLOCK_N
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x batch rows
    up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([0, k0])  # rows past M come back zero
        w = w_desc.load([lo, k0])
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        if SILU_MUL:  # a last gate tile past N reads up rows: their columns are masked below
            u = w_desc.load([N + lo, k0])
            if UPCAST:
                u = u.to(tl.float32)
            up = tl.dot(u, tl.trans(x), up, input_precision=PRECISION)
    n = lo + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        if SILU_MUL:
            up += tl.load(b_ptr + N + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    if SILU_MUL:
        acc = silu_mul_rounded(acc, up, y_ptr.dtype.element_ty)
    m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(n[:, None] < N) & (m[None, :] < M))


def launch_tma(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
               silu_mul: bool, block_n: int, block_k: int, num_stages: int, num_warps: int
               ) -> None:
    """y = out (M, N_out) from x (M, K) and W (N, K), checked by `gemv`; N_out = N / 2 with
    silu_mul. A descriptor needs 16-byte aligned rows, so K x itemsize must be a multiple of 16."""
    (m, k), n_out = x.shape, out.shape[1]
    check(k * x.element_size() % 16 == 0, "tma needs K x itemsize to be a multiple of 16 bytes")
    for t in (x, weight):
        check(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0,
              "tma needs 16-byte aligned rows")
    block_m = max(16, next_pow2(m))
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _gemv_tma_kernel[(triton.cdiv(n_out, block_n),)](
        w_desc, x_desc, out, bias if bias is not None else x, m, n_out, k, out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
        num_warps=num_warps, num_stages=num_stages, **pdl(x.device),
    )
