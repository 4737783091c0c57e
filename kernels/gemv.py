"""Skinny matmul for decode batches of 1-16 rows: y (M, N) = x (M, K) @ W (N, K)^T, W as nn.Linear.

Both variants stream W once, coalesced, with float32 accumulation: "stream" gives each program
BLOCK_N rows of W and multiplies on the CUDA cores (the M = 1 default); "dot" runs a BLOCK_N x
BLOCK_K tile of W against x padded to 16 rows on the tensor cores (the M >= 2 default). On an
H100 only some shapes beat cuBLAS, see `gemv_beats_cublas`. Split-K was measured and dropped:
it lost 5-45% at every Qwen3-0.6B / Llama-3.1-8B shape, tall-thin ones included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, dot_precision, is_interpreter, next_pow2, num_sms

MAX_ROWS = 16


@triton.jit
def _gemv_stream_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamped indices keep the W / x loads unmasked; the store masks the padding.
    m_c = tl.minimum(m, M - 1)
    n_c = tl.minimum(n, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced once, after the loop
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w_ptrs = w_ptr + n_c[:, None] * stride_wn + k[None, :]
        x_ptrs = x_ptr + m_c[:, None] * stride_xm + k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k[None, :] < K, other=0.0)
            x = tl.load(x_ptrs, mask=k[None, :] < K, other=0.0)
        w = w.to(tl.float32)
        x = x.to(tl.float32)
        if BLOCK_M == 1:
            acc2 += w * x  # (BLOCK_N, BLOCK_K) * (1, BLOCK_K)
        else:
            acc3 += x[:, None, :] * w[None, :, :]
    if BLOCK_M == 1:
        acc = tl.sum(acc2, 1)[None, :]  # (1, BLOCK_N)
    else:
        acc = tl.sum(acc3, 2)  # (BLOCK_M, BLOCK_N)
    y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _gemv_dot_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    m = tl.arange(0, 16)  # x padded to the smallest tensor-core tile
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_c = tl.minimum(m, M - 1)
    n_c = tl.minimum(n, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)  # y^T tile: W rows x batch rows
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        w_ptrs = w_ptr + n_c[:, None] * stride_wn + k[None, :]
        x_ptrs = x_ptr + m_c[:, None] * stride_xm + k[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k[None, :] < K, other=0.0)
            x = tl.load(x_ptrs, mask=k[None, :] < K, other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)  # (BLOCK_N, 16)
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(n[:, None] < N) & (m[None, :] < M))


def stream_config(m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): ~4 programs per SM (1 row each when N is small), 8 KB of W a step."""
    block_m = next_pow2(m)
    block_n = 1
    while block_n < 16 and triton.cdiv(n, 2 * block_n) >= 4 * num_sms(device):
        block_n *= 2
    per_step = 4096 // block_n if block_m == 1 else 8192 // (block_m * block_n)
    return block_n, min(next_pow2(k), max(64, per_step))


def dot_config(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the widest W tile that still gives ~2 programs per SM."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 2 * num_sms(device):
        block_n //= 2
    return block_n, 128 if block_n == 64 else 256


def gemv_beats_cublas(m: int, n: int) -> bool:
    """Where this kernel measured faster than F.linear (H100, bf16, CUDA-graph replays): every
    M = 1 shape (1.02-1.65x at Qwen3-0.6B / Llama-3.1-8B sizes), and M = 2..8 only for LM-head
    sized N (1.05-1.09x at N = 128k-152k; Llama gate_up N = 28672 ties, smaller N lose 3-31%)."""
    return m == 1 or (m <= 8 and n >= 65536)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    method: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x (M, K) with M <= 16, weight (N, K) -> (M, N) in x's dtype. `method`: "stream" (the
    default for M = 1) or "dot" (the default for M >= 2)."""
    check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], "x (M,K), W (N,K)")
    (m, k), n = x.shape, weight.shape[0]
    check(1 <= m <= MAX_ROWS, f"gemv is for 1..{MAX_ROWS} rows, got {m}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype, "x and W: one float dtype")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "x and W need a contiguous last dim")
    check(x.device == weight.device, "x and W on different devices")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check(out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1, "bad out")
    method = method or ("stream" if m == 1 else "dot")
    check(method in ("stream", "dot"), f"unknown method {method!r}")
    args = (x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    if method == "stream":
        cfg_n, cfg_k = stream_config(m, n, k, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        _gemv_stream_kernel[(triton.cdiv(n, block_n),)](
            *args, BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages or 3,
        )  # fmt: skip
    else:
        cfg_n, cfg_k = dot_config(n, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        _gemv_dot_kernel[(triton.cdiv(n, block_n),)](
            *args, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps, num_stages=num_stages or 4,
        )  # fmt: skip
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)
