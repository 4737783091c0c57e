"""Skinny matmul for decode batches: y (M, N) = x (M, K) @ W (N, K)^T, W as nn.Linear.

Both variants stream W once, coalesced, with float32 accumulation: "stream" gives each program
BLOCK_N rows of W and multiplies on the CUDA cores (one or two rows of x), with up to 3 W tiles in
flight where its loop over K is long (`stream_stages`); "dot" runs a BLOCK_N x BLOCK_K tile of W
against x padded to 16-128 rows (a power of two) on the tensor cores, with a deep pipeline (a
program may take fewer W rows than its tile, the rest masked, so that a grid fills whole waves);
its "split" form also divides K among programs (float32 partials, then a fixed-order sum,
which a decoder layer leaves to the next norm: `SplitSum`), which fills the SMs for down
projections at 33-128 rows; "tma" (`gemv_tma`, Hopper) is the dot product with W and x fetched
through tensor descriptors. `gemv_config` says which one (or cuBLAS) a shape takes, and its
tiles. No split-K at 1-32 rows: it lost 5-45% at every 0.6B-8B shape, tall-thin ones included.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check,
    dot_precision,
    is_interpreter,
    next_pow2,
    pdl,
    pdl_sync,
    silu_mul_rounded,
)
from .gemv_config import (
    MAX_DOT_ROWS,
    MAX_SPLIT_ROWS,
    MAX_STREAM_ROWS,
    dot_config,
    gemv_method,
    split_config,
    stream_config,
    stream_stages,
    tma_config,
    x_tile,
)
from .gemv_tma import launch_tma


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
):
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


# M (1 or 2 rows: gemv_method) stays specialized: eager steps add no variant the start-up warm-up
# misses, and a constant M = 1 is what a batch-1 decode step runs.
@triton.jit
def _gemv_stream_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    nw_ptr, res_ptr, res_out_ptr, eps, stride_rm, stride_rom,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ONE_TILE: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
):
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
        # kernel before (PDL), and its DRAM latency overlaps that kernel's tail (1-5% tok/s at
        # batch 1). Fetching the first of several tiles early too cost 1-2% at 1B-8B.
        w = _load_tile(w_rows + kk[None, :], kk, K, EVEN_K)
        pdl_sync(USE_PDL)
        acc, sum_sq = _stream_step(
            acc, sum_sq, w, kk, x_ptr, stride_xm, m, m_c, M, K, pid,
            nw_ptr, res_ptr, res_out_ptr, stride_rm, stride_rom,
            BLOCK_M, EVEN_K, PROLOGUE, HAS_RES,
        )
    else:
        pdl_sync(USE_PDL)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
            k = k0 + kk
            w = _load_tile(w_rows + k[None, :], k, K, EVEN_K)
            acc, sum_sq = _stream_step(
                acc, sum_sq, w, k, x_ptr, stride_xm, m, m_c, M, K, pid,
                nw_ptr, res_ptr, res_out_ptr, stride_rm, stride_rom,
                BLOCK_M, EVEN_K, PROLOGUE, HAS_RES,
            )
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


# The row count M is never specialized on (Triton would compile a variant for 1 and for multiples
# of 16): eager steps take any count, and a variant compiled mid-run stalls every stream.
@triton.jit(do_not_specialize=["M"])
def _gemv_dot_kernel(
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, K_PER_SPLIT, ROWS, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    MASK_ROWS: tl.constexpr, MASK_X: tl.constexpr, SPLIT: tl.constexpr, SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program i takes W rows [i ROWS, (i + 1) ROWS); MASK_ROWS: fewer than BLOCK_N, the rest of
    the tile masked off (never fetched). SPLIT: program (i, s) sums K range s (K_PER_SPLIT wide,
    whole tiles) into float32 partials y[s] (M x N each, stride_ym); `_split_reduce_kernel` adds
    them up. SILU_MUL: W is [gate; up] (2N x K) and y silu(gate) * up (M x N); program i takes
    gate rows [i ROWS, (i + 1) ROWS) in the top half of its tile and the same up rows in the
    bottom half, so that its epilogue holds both factors of each output."""
    pdl_sync(USE_PDL)
    m = tl.arange(0, BLOCK_M)  # x padded to a tensor-core tile (16 rows at least)
    lo = tl.program_id(0) * ROWS
    if SILU_MUL:
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)  # gate rows, then the same up rows
        n = lo + half
        up_rows = tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, 0, N)
    else:
        n = lo + tl.arange(0, BLOCK_N)
        up_rows = 0
    end = tl.minimum(lo + ROWS, N)
    # MASK_X: rows of the tile past M load zeros. Pointing them at row M - 1 instead made them
    # all re-read one address: 1.3-1.7x slower at 40-112 rows than at 64 or 128.
    x_rows = (m < M)[:, None]
    n_c = (tl.minimum(n, end - 1) + up_rows).to(tl.int64)  # a partial last tile re-reads its
    w_rows = (n < end)[:, None]  # last row; w_rows all true unless MASK_ROWS
    kk = tl.arange(0, BLOCK_K)
    k_lo = 0
    k_hi = K
    if SPLIT:
        k_lo = tl.program_id(1) * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
        y_ptr += tl.program_id(1).to(tl.int64) * M * stride_ym
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T tile: W rows x batch rows
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        w_ptrs = w_ptr + n_c[:, None] * stride_wn + k[None, :]
        x_ptrs = x_ptr + m[:, None] * stride_xm + k[None, :]
        if MASK_ROWS:
            w = tl.load(w_ptrs, mask=w_rows & (k[None, :] < K), other=0.0)
        elif EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k[None, :] < K, other=0.0)
        if MASK_X:
            x = tl.load(x_ptrs, mask=x_rows & (k[None, :] < K), other=0.0)
        elif EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k[None, :] < K, other=0.0)
        if UPCAST:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n_c).to(tl.float32)[:, None]
    if SILU_MUL:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))
        acc = silu_mul_rounded(gate, up, y_ptr.dtype.element_ty)
        n = lo + tl.arange(0, BLOCK_N // 2)
    y_ptrs = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(n[:, None] < end) & (m[None, :] < M))


@triton.jit
def split_sum(p_ptrs, split_stride, mask, b_ptr, n, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """sum over s of the float32 partials p[s] (+ bias) in split order, the one order every
    consumer of a split-K product uses (deterministic)."""
    acc = tl.load(p_ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptrs + s * split_stride, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])  # as the dot kernel
def _split_reduce_kernel(
    p_ptr, y_ptr, b_ptr, r_ptr, M, N, stride_ym, stride_rm,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[m] = sum over s of the partials p[s, m] (+ bias) (+ residual[m], added after the sum is
    rounded to the residual's dtype, as HF adds a projection's output)."""
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = split_sum(p_ptr + row * N + n, M * N, mask, b_ptr, n, SPLITS, HAS_BIAS)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_rm + n, mask=mask, other=0.0)
        acc = acc.to(r.dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


class SplitSum(NamedTuple):
    """A split-K product not yet summed: float32 partials (S, M, N), the bias, and the dtype the
    sum rounds to. `reduce` sums it (as `gemv` does); `rms_norm` sums it in its own pass, which
    saves the reduce kernel where a norm reads the product (a decoder layer's o and down
    projections at 33-128 rows). `shape` and `is_cuda` are the product's, for the shape rules."""

    partials: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]

    @property
    def is_cuda(self) -> bool:
        return self.partials.is_cuda

    def reduce(self, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The sum (+ residual, in the residual's dtype: HF's add), into `out` if given."""
        p = self.partials
        splits, m, n = p.shape
        dtype = self.dtype if residual is None else residual.dtype
        if out is None:
            out = torch.empty(m, n, dtype=dtype, device=p.device)
        check(out.shape == (m, n) and out.stride(1) == 1, f"out must be ({m}, {n}), stride 1")
        if residual is not None:
            check(residual.shape == (m, n) and residual.stride(1) == 1 and out.dtype == dtype,
                  f"the residual must be ({m}, {n}), stride 1, in out's dtype")
        block = min(1024, next_pow2(n))
        r = out if residual is None else residual
        _split_reduce_kernel[(m, triton.cdiv(n, block))](
            p, out, self.bias if self.bias is not None else p, r, m, n, out.stride(0),
            r.stride(0), SPLITS=splits, HAS_BIAS=self.bias is not None,
            HAS_RES=residual is not None, BLOCK=block, num_warps=4, **pdl(p.device),
        )
        return out


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
    silu_mul: bool = False,
    method: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    rows: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_splits: int | None = None,
    reduce: bool = True,
) -> torch.Tensor | SplitSum:
    """x (M, K) with M <= MAX_DOT_ROWS (MAX_SPLIT_ROWS for "split"), weight (N, K) -> (M, N) in x's
    dtype, or float32 into a float32 `out` (rounded once, from the float32 sum), + bias (N,).
    `method`: "stream", "dot", "split" or "tma" (default: `gemv_method`'s choice, or "stream" for a
    prologue).

    Prologues (stream only) fuse the op that feeds a decode matmul, saving a launch and a pass:
    `norm=(norm_weight (K,), eps)` multiplies RMSNorm(x + residual) instead of x and writes
    x + residual to `residual_out` (must not alias x or residual); `gated=True` takes x as
    [gate | up] (M, 2K) and multiplies silu(gate) * up. The epilogue `silu_mul=True` (dot only)
    takes W as [gate; up] (2N, K) and returns silu(x gate^T) * (x up^T) (M, N), each factor
    rounded as HF's separate projections are: the SiLU kernel and its pass over the (M, 2N)
    product are saved. `block_n`, `block_k`, `rows` (dot only: W rows a program takes, at most
    block_n; even with silu_mul), `num_warps`, `num_stages`, `num_splits` (split only) override
    the tuned configuration. `reduce=False` (split only, no `out`) returns the partials not yet
    summed, a `SplitSum`."""
    check(x.dim() == 2 and weight.dim() == 2, "x must be (M, K), W (N, K)")
    (m, kx), (n, k) = x.shape, weight.shape
    check(kx == (2 * k if gated else k), f"x has {kx} columns, W {k}" + (" (x2: gated)" * gated))
    if method is None:  # a prologue streams; cuBLAS's shapes: the row check below says so
        method = "stream" if gated or norm is not None else gemv_method(m, n, k) or "dot"
    if silu_mul:
        check(method in ("dot", "tma") and not (gated or norm),
              "silu_mul is the dot and tma kernels' epilogue")
        check(n % 2 == 0, f"silu_mul needs W as [gate; up], got {n} rows")
        check(out is None or out.dtype == x.dtype, "silu_mul: out in x's dtype")
    n_out = n // 2 if silu_mul else n
    max_rows = MAX_SPLIT_ROWS if method == "split" else MAX_DOT_ROWS
    check(1 <= m <= max_rows, f"gemv {method} is for 1..{max_rows} rows, got {m}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype == x.dtype, "x and W: one float dtype")
    check(x.stride(1) == 1 and weight.stride(1) == 1, "x and W need a contiguous last dim")
    tensors = [x, weight]
    check(reduce or (method == "split" and out is None), "reduce=False is split's, with no out")
    if out is None and reduce:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if out is not None:
        shape_ok = out.shape == (m, n_out) and out.stride(1) == 1
        check(shape_ok, f"out must be ({m}, {n_out}), stride 1")
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
                      "residual / residual_out must match x")
            check(
                residual_out.data_ptr() not in (x.data_ptr(), residual.data_ptr()),
                "residual_out must not alias x or residual (other programs still read them)",
            )
            res, res_out = residual, residual_out
            tensors += [residual, residual_out]
    else:
        check(residual is None, "a residual needs the norm prologue")
    check(len({t.device for t in tensors}) == 1, "all inputs on one device")
    check(method in ("stream", "dot", "split", "tma"), f"unknown method {method!r}")
    check(method != "stream" or m <= MAX_STREAM_ROWS, f"stream is for 1..{MAX_STREAM_ROWS} rows")
    check(method == "stream" or not prologue, f"{method} has no prologue")
    if method == "stream":
        cfg_n, cfg_k = stream_config(m, n, k, x.device, prologue)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        stages = num_stages or stream_stages(m, k, block_n, block_k, x.element_size(), x.device)
        _gemv_stream_kernel[(triton.cdiv(n, block_n),)](
            x, weight, out, bias if bias is not None else x, m, n, k, x.stride(0),
            weight.stride(0), out.stride(0), norm_w, res, res_out, eps, res.stride(0),
            res_out.stride(0),
            BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            ONE_TILE=k <= block_k, PROLOGUE=prologue, HAS_RES=residual is not None,
            HAS_BIAS=bias is not None, LOOP_STAGES=stages, num_warps=num_warps or 4,
            **pdl(x.device),
        )
    elif method == "tma":
        cfg_n, cfg_k, cfg_stages, cfg_warps = tma_config(silu_mul)
        launch_tma(x, weight, out, bias, silu_mul, block_n or cfg_n, block_k or cfg_k,
                   num_stages or cfg_stages, num_warps or cfg_warps)
    elif method == "dot":
        block_m, mask_x = x_tile(m)
        cfg = dot_config(m, n, k, x.dtype, x.device)
        block_n, block_k = block_n or cfg.block_n, block_k or cfg.block_k
        rows = rows or min(cfg.rows + (cfg.rows % 2) * silu_mul, block_n)
        check(1 <= rows <= block_n, f"rows must be 1..{block_n}, got {rows}")
        check(not silu_mul or rows % 2 == 0, f"silu_mul: rows must be even, got {rows}")
        rows //= 1 + silu_mul  # gate rows (output columns) a program takes, with their up rows
        _gemv_dot_kernel[(triton.cdiv(n_out, rows), 1)](
            x, weight, out, bias if bias is not None else x, m, n_out, k, k, rows, x.stride(0),
            weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, EVEN_K=k % block_k == 0, MASK_ROWS=rows < block_n // (1 + silu_mul),
            MASK_X=mask_x, SPLIT=False, SILU_MUL=silu_mul, HAS_BIAS=bias is not None,
            PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps or cfg.warps, num_stages=num_stages or cfg.stages, **pdl(x.device),
        )
    else:
        block_m, mask_x = x_tile(m)
        cfg_n, cfg_k, cfg_stages, splits = split_config(m, n, k, x.dtype, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        per_split = triton.cdiv(triton.cdiv(k, num_splits or splits), block_k)
        per_split *= block_k  # whole tiles, so only the last split's last tile is partial
        splits = triton.cdiv(k, per_split)
        partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        _gemv_dot_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, partials, x, m, n, k, per_split, block_n, x.stride(0), weight.stride(0), n,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            MASK_ROWS=False, MASK_X=mask_x, SPLIT=True, SILU_MUL=False, HAS_BIAS=False,
            PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps or 4, num_stages=num_stages or cfg_stages, **pdl(x.device),
        )
        product = SplitSum(partials, bias, x.dtype)
        if not reduce:
            return product
        product.reduce(out=out)
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
