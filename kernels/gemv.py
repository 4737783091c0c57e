"""Skinny matmul for decode batches: y (M, N) = x (M, K) @ W (N, K)^T, W as nn.Linear.

Both variants stream W once, coalesced, with float32 accumulation: "stream" gives each program
BLOCK_N rows of W and multiplies on the CUDA cores (one or two rows of x); "dot" runs a
BLOCK_N x BLOCK_K tile of W against x padded to 16 or 32 rows on the tensor cores, with a deep
pipeline. `gemv_method` says which one (or cuBLAS) a shape takes. Split-K was measured and
dropped: it lost 5-45% at every Qwen3-0.6B / Llama-3.1-8B shape, tall-thin ones included.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check,
    dot_precision,
    is_interpreter,
    next_pow2,
    num_sms,
    pdl,
    pdl_sync,
    shared_memory,
)

MAX_ROWS = 32  # the dot kernel's: at 48-64 rows it lost up to 29% to cuBLAS (H100)
MAX_STREAM_ROWS = 16  # the stream kernel keeps an (M, BLOCK_N, BLOCK_K) fp32 accumulator


@triton.jit
def _load_tile(ptrs, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(k < K)[None, :], other=0.0)


@triton.jit
def _stream_step(
    acc, sum_sq, w, k, x_ptr, stride_xm, m, m_c, M, K, pid,
    nw_ptr, res_ptr, res_out_ptr, stride_rm, stride_rom,
    BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """acc += x[:, k] * W[n, k] for one K tile, after the prologue; returns (acc, sum_sq)."""
    k_mask = (k < K)[None, :]
    x_ptrs = x_ptr + m_c[:, None] * stride_xm + k[None, :]
    x = _load_tile(x_ptrs, k, K, EVEN_K)
    if PROLOGUE == 1:  # x <- (x + residual) * norm weight; 1/rms scales the sum at the end
        if HAS_RES:
            r_ptrs = res_ptr + m_c[:, None] * stride_rm + k[None, :]
            x = x.to(tl.float32) + tl.load(r_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            x = x.to(w.dtype)  # the residual stream is rounded like HF's bf16 add
            if pid == 0:  # one program writes the new residual stream
                ro_ptrs = res_out_ptr + m[:, None] * stride_rom + k[None, :]
                tl.store(ro_ptrs, x, mask=k_mask & (m[:, None] < M))
        x = x.to(tl.float32)
        sum_sq += tl.sum(x * x, 1, keep_dims=True)
        x = x * tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
    elif PROLOGUE == 2:  # x = [gate | up] (M, 2K) -> silu(gate) * up, rounded as HF's
        up = tl.load(x_ptrs + K, mask=k_mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(w.dtype).to(tl.float32)
        x = (act * up).to(w.dtype).to(tl.float32)
    else:
        x = x.to(tl.float32)
    w = w.to(tl.float32)
    if BLOCK_M == 1:
        acc += w * x  # (BLOCK_N, BLOCK_K) * (1, BLOCK_K)
    else:
        acc += x[:, None, :] * w[None, :, :]
    return acc, sum_sq


@triton.jit
def _gemv_stream_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    nw_ptr, res_ptr, res_out_ptr, eps, stride_rm, stride_rom,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_TILE: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    m = tl.arange(0, BLOCK_M)
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # Clamped indices keep the W / x loads unmasked; the store masks the padding.
    m_c = tl.minimum(m, M - 1)
    n_c = tl.minimum(n, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced once, after the loop
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    sum_sq = tl.zeros([BLOCK_M, 1], tl.float32)  # RMSNorm prologue: sum of x^2 over K
    w_rows = w_ptr + n_c[:, None] * stride_wn
    if ONE_TILE:  # K <= BLOCK_K
        # One tile: W is never written while decoding, so it is fetched before waiting on the
        # kernel before (PDL), and its DRAM latency overlaps that kernel's tail. H100 latency:
        # Qwen3-0.6B 1,137 -> 1,197 tok/s, Llama-3.2-1B 834 -> 844. Fetching the first of
        # several tiles early too gave Qwen3-0.6B 1,249 but cost Llama-3.2-1B 2%, 8B 1%.
        w = _load_tile(w_rows + kk[None, :], kk, K, EVEN_K)
        pdl_sync(USE_PDL)
        acc, sum_sq = _stream_step(
            acc, sum_sq, w, kk, x_ptr, stride_xm, m, m_c, M, K, pid,
            nw_ptr, res_ptr, res_out_ptr, stride_rm, stride_rom,
            BLOCK_M, EVEN_K, PROLOGUE, HAS_RES,
        )  # fmt: skip
    else:
        pdl_sync(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            w = _load_tile(w_rows + k[None, :], k, K, EVEN_K)
            acc, sum_sq = _stream_step(
                acc, sum_sq, w, k, x_ptr, stride_xm, m, m_c, M, K, pid,
                nw_ptr, res_ptr, res_out_ptr, stride_rm, stride_rom,
                BLOCK_M, EVEN_K, PROLOGUE, HAS_RES,
            )  # fmt: skip
    if BLOCK_M == 1:
        acc = tl.sum(acc, 1)[None, :]  # (1, BLOCK_N)
    else:
        acc = tl.sum(acc, 2)  # (BLOCK_M, BLOCK_N)
    if PROLOGUE == 1:
        acc = acc * tl.math.rsqrt(sum_sq / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_c).to(tl.float32)[None, :]
    y_ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _gemv_dot_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_sync(USE_PDL)
    m = tl.arange(0, BLOCK_M)  # x padded to a tensor-core tile (16 rows at least)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_c = tl.minimum(m, M - 1)
    n_c = tl.minimum(n, N - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x batch rows
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
        acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_c).to(tl.float32)[:, None]
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(n[:, None] < N) & (m[None, :] < M))


def stream_config(m: int, n: int, k: int, device: torch.device, prologue: int = 0
                  ) -> tuple[int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K): ~4 programs per SM (1 row each when N is small), 8 KB of W a step.
    A prologue (1: norm, 2: gated) reads x in every program, so each takes more W rows."""
    block_m = next_pow2(m)
    if prologue == 2 and m > 1:  # all of x (M x 2K) a program: 8 W rows, 8K products a step.
        # H100, M = 2: MiMo-7B down 41.6 -> 37.6 us, Llama-3.1-8B 52.1 -> 45.9, Qwen3-0.6B
        # 20.1 -> 6.6 (it took the rule below: 4 rows x 4096, a tile that spills). At M = 1
        # this rule measured 3% slower end to end on Qwen3-0.6B (1,101 vs 1,133 tok/s), though
        # faster alone, so M = 1 keeps the rule below.
        return 8, min(next_pow2(k), 8192 // (8 * block_m))
    if block_m == 1 and n >= 32768:  # LM heads, 16 x 256 before. H100: Qwen3-0.6B's 105.8
        return 8, min(next_pow2(k), 1024)  # -> 104.9 us, Llama-3.2-1B 173.8 -> 169.9, 8B 346 -> 340
    # One row, no prologue: at least 2 W rows a program (Qwen3-0.6B's attention out: 3.17 ->
    # 2.90 us). Not with a prologue: its down projection's 1 x 4096 step (one tile) would halve.
    block_n = 2 if block_m == 1 and not prologue else 1
    while block_n < 16 and triton.cdiv(n, 2 * block_n) >= 4 * num_sms(device):
        block_n *= 2
    per_step = 4096 // block_n if block_m == 1 else 8192 // (block_m * block_n)
    block_k = min(next_pow2(k), max(64, per_step))
    if prologue:  # rows per program measured best at 4 (gated) / 8 (norm)
        block_n = max(block_n, 4 if prologue == 2 else 8)
        if block_n * next_pow2(k) <= 8192:  # one tile, fetched before the PDL wait (below):
            block_k = next_pow2(k)  # H100, Qwen3-0.6B gate_up 7.7-7.9 -> 6.1-6.3 us (was 8 x 512)
    return block_n, block_k


def dot_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K, stages): the widest W tile that still gives every other SM a program
    (128 x 128, 64 x 128 or 32 x 256), as many stages in flight as shared memory holds, up to
    5. H100, bf16, M = 2..16, against the old ~2 programs per SM and 4 stages: MiMo-7B qkv 35.3
    -> 20.3 us, gate_up 66.2 -> 64.0 us, LM heads 0.5-1% faster; a deep pipeline over few
    programs streams W faster than many shallow ones (`scratch` sweeps in BENCHMARKS.md)."""
    block_n = 128
    while block_n > 32 and triton.cdiv(n, block_n) < num_sms(device) // 2:
        block_n //= 2
    block_k = 256 if block_n == 32 else 128
    smem, rows = shared_memory(device), max(16, next_pow2(m))
    while block_k > 32 and 2 * (block_n + rows) * block_k * dtype.itemsize > smem:
        block_k //= 2  # two stages must fit: float32 at 32 rows on a 100 KB consumer card
    return block_n, block_k, min(5, smem // ((block_n + rows) * block_k * dtype.itemsize))


def gemv_method(m: int, n: int, k: int) -> str | None:
    """Which kernel runs an (M, K) x (N, K)^T matmul fastest on an H100 (bf16, CUDA-graph
    replays, BENCHMARKS.md): "stream" for one row, and for two rows of W with N <= K (attention
    out, down: 4-30% over the dot kernel); "dot" for the rest up to MAX_ROWS rows, 1-40% over
    cuBLAS at Qwen3-0.6B to Llama-3.1-8B shapes; None (cuBLAS) above."""
    if m == 1 or (m == 2 and n <= k):
        return "stream"
    return "dot" if m <= MAX_ROWS else None


def norm_prologue_pays(k: int) -> bool:
    """Where gemv(norm=...) beat rms_norm + gemv at M = 1 (H100, bf16, graph replays): K = 1024
    (Qwen3-0.6B qkv 6.2 vs 7.1 us, gate_up 8.1 vs 8.8 us); at K = 4096 (Llama-3.1-8B) the
    prologue's extra x / residual / weight reads per program cost more than the launch it saves
    (qkv 24.0 vs 22.9 us, gate_up 91.9 vs 86.1 us)."""
    return k <= 2048


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    gated: bool = False,
    method: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x (M, K) with M <= MAX_ROWS, weight (N, K) -> (M, N) in x's dtype, or float32 into a float32
    `out` (rounded once, from the float32 accumulator), + bias (N,). `method`: "stream" or "dot"
    (default: `gemv_method`'s choice, or "stream" for a prologue).

    Prologues (stream only) fuse the op that feeds a decode matmul, saving a launch and a pass:
    `norm=(norm_weight (K,), eps)` multiplies RMSNorm(x + residual) instead of x and writes
    x + residual to `residual_out` (must not alias x or residual); `gated=True` takes x as
    [gate | up] (M, 2K) and multiplies silu(gate) * up."""
    check(x.dim() == 2 and weight.dim() == 2, "x must be (M, K), W (N, K)")
    (m, kx), (n, k) = x.shape, weight.shape
    check(kx == (2 * k if gated else k), f"x has {kx} columns, W {k}" + (" (x2: gated)" * gated))
    check(1 <= m <= MAX_ROWS, f"gemv is for 1..{MAX_ROWS} rows, got {m}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype, "x and W: one float dtype")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "x and W need a contiguous last dim")
    tensors = [x, weight]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check(out.shape == (m, n) and out.stride(1) == 1, f"out must be ({m}, {n}), stride 1")
    check(out.dtype in (x.dtype, torch.float32), "out: x's dtype or float32")
    if bias is not None:
        check(bias.shape == (n,) and bias.dtype == x.dtype and bias.is_contiguous(), "bad bias")
        tensors.append(bias)
    prologue = 2 if gated else 0
    norm_w, eps, res, res_out = x, 0.0, x, x  # placeholders for the unused pointers
    if norm is not None:
        check(not gated, "norm and gated prologues are exclusive")
        prologue, (norm_w, eps) = 1, norm
        check(norm_w.shape == (k,) and norm_w.is_contiguous(), "norm weight must be (K,)")
        tensors.append(norm_w)
        if residual is not None:
            check(residual_out is not None, "a residual needs residual_out")
            for t in (residual, residual_out):
                check(t.shape == x.shape and t.dtype == x.dtype and t.stride(1) == 1,
                      "residual / residual_out must match x")  # fmt: skip
            check(
                residual_out.data_ptr() not in (x.data_ptr(), residual.data_ptr()),
                "residual_out must not alias x or residual (other programs still read them)",
            )
            res, res_out = residual, residual_out
            tensors += [residual, residual_out]
    else:
        check(residual is None, "a residual needs the norm prologue")
    check(len({t.device for t in tensors}) == 1, "all inputs on one device")
    if method is None:
        method = "stream" if prologue else gemv_method(m, n, k)
    check(method in ("stream", "dot"), f"unknown method {method!r}")
    check(method == "dot" or m <= MAX_STREAM_ROWS, f"stream is for 1..{MAX_STREAM_ROWS} rows")
    check(method == "stream" or not prologue, "dot has no prologue")
    args = (x, weight, out)
    sizes = (m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    if method == "stream":
        cfg_n, cfg_k = stream_config(m, n, k, x.device, prologue)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        _gemv_stream_kernel[(triton.cdiv(n, block_n),)](
            *args, bias if bias is not None else x, *sizes,
            norm_w, res, res_out, eps, res.stride(0), res_out.stride(0),
            BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            ONE_TILE=k <= block_k, PROLOGUE=prologue, HAS_RES=residual is not None,
            HAS_BIAS=bias is not None,
            num_warps=num_warps, num_stages=num_stages or 3, **pdl(x.device),
        )  # fmt: skip
    else:
        cfg_n, cfg_k, cfg_stages = dot_config(m, n, k, x.dtype, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        _gemv_dot_kernel[(triton.cdiv(n, block_n),)](
            *args, bias if bias is not None else x, *sizes, BLOCK_M=max(16, next_pow2(m)),
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps, num_stages=num_stages or cfg_stages, **pdl(x.device),
        )  # fmt: skip
    return out


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """The unfused ops in HF's order and rounding (layers/norm.py, layers/activation.py)."""
    if norm is not None:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        x = norm[0] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm[1])).to(x.dtype)
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    return torch.nn.functional.linear(x, weight, bias)
