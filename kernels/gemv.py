"""Skinny matmul for decode batches: y (M, N) = x (M, K) @ W (N, K)^T, W as nn.Linear.

Both variants stream W once, coalesced, with float32 accumulation: "stream" gives each program
BLOCK_N rows of W and multiplies on the CUDA cores (one or two rows of x), with up to 3 W tiles
in flight where its loop over K is long (`stream_stages`); "dot" runs a
BLOCK_N x BLOCK_K tile of W against x padded to 16-128 rows (a power of two) on the tensor
cores, with a deep pipeline; its "split" form also divides K among programs (float32 partials,
then a fixed-order sum), which fills the SMs for down projections at 33-128 rows.
`gemv_method` says which one (or cuBLAS) a shape takes. Split-K at 1-32 rows was measured and
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

MAX_ROWS = 32  # the dot kernel's for any W: at 48-64 rows it lost up to 29% to cuBLAS (H100)
WIDE_N = 16384  # ...but for W this wide (gate_up of 1B-8B models, LM heads) it wins to 64 rows
HEAD_N = 32768  # W this wide is an LM head (or a 32k draft head)
LARGE_K = 4096  # 7-8B models' hidden size: their few-row rules were measured on the H200
MAX_DOT_ROWS = 64  # x is one tile of at most this many rows
MAX_SPLIT_ROWS = 128  # the split-K form's, for down projections (measured at 64 and 128 rows)
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
    LOOP_STAGES: tl.constexpr, USE_PDL: tl.constexpr,
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
        for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
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
    x_ptr, w_ptr, y_ptr, b_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """SPLIT: program (i, s) sums K range s (K_PER_SPLIT wide, whole tiles) into float32
    partials y[s] (M x N each, stride_ym); `_split_reduce_kernel` adds them up."""
    pdl_sync(USE_PDL)
    m = tl.arange(0, BLOCK_M)  # x padded to a tensor-core tile (16 rows at least)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_c = tl.minimum(m, M - 1)
    n_c = tl.minimum(n, N - 1).to(tl.int64)
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


@triton.jit
def _split_reduce_kernel(
    p_ptr, y_ptr, b_ptr, M, N, stride_ym,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """y[m] = sum over s of the partials p[s, m] (+ bias), in a fixed order (deterministic)."""
    pdl_sync(USE_PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    p_ptrs = p_ptr + row * N + n
    acc = tl.load(p_ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptrs + s * M * N, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


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
    if block_m == 2 and k >= LARGE_K and not prologue:  # 7-8B models' attention in / out
        # With 3 stages (`stream_stages`). H200, MiMo-7B at two rows, us a call: attention out
        # 11.3 -> 10.8, eh_proj 19.2 -> 18.3 (16 x 512, was 4 x 512); qkv 16.7 (cuBLAS) -> 15.9
        # (4 x 256); MTP k=1 batch-1 step 4.44 -> 4.34 ms (BENCHMARKS.md, thirtieth session).
        return (16, 512) if n <= k else (4, 256)
    if block_m == 1 and n >= HEAD_N:  # LM heads, 16 x 256 before. H100: Qwen3-0.6B's 105.8
        return 8, min(next_pow2(k), 1024)  # -> 104.9 us, Llama-3.2-1B 173.8 -> 169.9, 8B 346 -> 340
    # One row, no prologue: at least 2 W rows a program (Qwen3-0.6B's attention out: 3.17 ->
    # 2.90 us). Not with a prologue: its down projection's 1 x 4096 step (one tile) would halve.
    block_n = 2 if block_m == 1 and not prologue else 1
    while block_n < 16 and triton.cdiv(n, 2 * block_n) >= 4 * num_sms(device):
        block_n *= 2
    # 4K products a step for one or two rows: H200, M = 2, MiMo-7B's attention out 13.1 -> 11.7
    # us (4 x 512, was 4 x 1024), eh_proj 22.0 -> 20.4 (BENCHMARKS.md, twenty-ninth session).
    per_step = 4096 // (block_m * block_n) if block_m <= 2 else 8192 // (block_m * block_n)
    block_k = min(next_pow2(k), max(64, per_step))
    if prologue:  # rows per program measured best at 4 (gated) / 8 (norm)
        block_n = max(block_n, 4 if prologue == 2 else 8)
        if block_n * next_pow2(k) <= 8192:  # one tile, fetched before the PDL wait (below):
            block_k = next_pow2(k)  # H100, Qwen3-0.6B gate_up 7.7-7.9 -> 6.1-6.3 us (was 8 x 512)
    return block_n, block_k


def stream_stages(m: int, k: int, block_n: int, block_k: int, itemsize: int,
                  device: torch.device) -> int:  # fmt: skip
    """W tiles a stream program keeps in flight: 3 (2 fetched ahead, through shared memory) once
    it loops over 16 or more K tiles, or for two rows at K >= 4096; else 1 (fetch, then use).
    H200, MiMo-7B, us a call: gate_up at 1 row 48.4 -> 44.6-44.8 (16 tiles), gated down at 2 rows
    28.2 -> 25.0 (22 tiles), attention out at 2 rows in 16 x 512 tiles 12.8 -> 10.8 (8 tiles);
    short loops at one row gain nothing or lose (attention out, 4 tiles: 9.6 -> 10.2;
    BENCHMARKS.md, thirtieth session). Without the loop's own stage count Triton pipelines only
    the loads that feed a tl.dot, so this kernel's never were. The 3 stages of W and x tiles
    (x: up to 3 rows' worth per row, for [gate | up] and a residual) must fit in shared memory:
    float32 16 x 512 tiles do not on a ~100 KB consumer card."""
    long_loop = triton.cdiv(k, block_k) >= 16 or (m == 2 and k >= LARGE_K)
    tiles = 3 * (block_n + 3 * next_pow2(m) + 1) * block_k * itemsize
    return 3 if long_loop and tiles <= shared_memory(device) else 1


def dot_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K, stages): the widest W tile that still gives every other SM a program (128
    x 128, 64 x 128 or 32 x 256), as many stages in flight as shared memory holds, up to 5 (or more,
    so that a program holds an SM alone: `_fit_pipeline`). H100, bf16, M = 2..16, against the old ~2
    programs per SM and 4 stages: MiMo-7B qkv 35.3 -> 20.3 us, gate_up 66.2 -> 64.0 us, LM heads
    0.5-1% faster; a deep pipeline over few programs streams W faster than many shallow ones
    (`scratch` sweeps in BENCHMARKS.md)."""
    sms, block_n = num_sms(device), 128
    while block_n > 32 and triton.cdiv(n, block_n) < sms // 2:
        block_n //= 2
    if m > 8 and block_n == 128 and _last_wave_fill(n, 64, sms) > _last_wave_fill(n, 128, sms):
        # A 128-wide program holds an SM alone, so a last wave on few SMs streams its W slowly.
        # H200, MiMo-7B gate_up (172 programs of 128: the second wave on 40 SMs), steady decode
        # steps: batch 64 5.31 -> 5.14 ms (twenty-eighth session); batch 16 4.37 -> 4.31, 32
        # 4.43 -> 4.35, MTP verify at 16 / 32 rows 4.51 -> 4.44, 4.78 -> 4.70. At 2-4 rows it
        # lost (plain batch 2 4.09 -> 4.14 ms), at 8 it tied (thirty-first session).
        block_n = 64
    block_k = 256 if block_n == 32 else 128
    return block_n, *_fit_pipeline(m, block_n, block_k, dtype, device, max_stages=5)


def _last_wave_fill(n: int, block_n: int, sms: int) -> float:
    """The share of the SMs the grid's waves keep busy, one program an SM."""
    programs = triton.cdiv(n, block_n)
    return programs / (triton.cdiv(programs, sms) * sms)


def _fit_pipeline(m: int, block_n: int, block_k: int, dtype: torch.dtype, device: torch.device,
                  max_stages: int) -> tuple[int, int]:  # fmt: skip
    """(BLOCK_K, stages) of a dot tile: BLOCK_K halved until two stages of W and x tiles fit in
    shared memory (float32 at 32 rows on a 100 KB consumer card), then as many stages as fit,
    up to max_stages, and at least enough that one program holds over half of an SM's shared
    memory where they fit: no two programs of a grid share an SM.

    The 32- and 64-wide tiles and split-K make grids of about one program an SM or fewer, and
    under PDL a kernel's programs are placed while the kernel before it still runs, on the SMs
    that have room then. Where two fitted on one SM they were stacked in pairs on part of the
    GPU, each pair streaming W at one SM's rate. H200, MiMo-7B at 16 rows, 5 -> 6-7 stages
    (4 -> 5-7 tiles held): plain decode batch 16 4.73 -> 4.42 ms a step; dot at 8 rows then
    beat cuBLAS, 4.54 -> 4.30 (BENCHMARKS.md, thirty-first session). Triton holds stages - 1
    tiles (mma v2, 32-wide W tiles) or stages (wgmma), hence the + 2."""
    smem, rows = shared_memory(device), max(16, next_pow2(m))
    while block_k > 32 and 2 * (block_n + rows) * block_k * dtype.itemsize > smem:
        block_k //= 2
    stage = (block_n + rows) * block_k * dtype.itemsize
    exclusive = smem // 2 // stage + 2
    return block_k, min(smem // stage, max(max_stages, exclusive))


def split_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[int, int, int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K, stages, splits) of the split-K dot kernel: 64 x 128 W tiles, 4 stages (5
    at 64 rows: `_fit_pipeline`), K split in up to 4 so the grid fills the SMs once. H100 sweep,
    bf16, M = 64 / 128, us against cuBLAS (which splits K itself at 64 rows): MiMo-7B down 36.8 /
    39.3 vs 38.6 / 41.3, Llama-3.1-8B down 46.1 / 50.1 vs 48.6 / 54.1, Llama-3.2-1B down 15.6 / 17.9
    vs 18.0 / 19.7, Qwen3-0.6B down 6.2 / 7.4 vs 8.4 / 7.5 (BENCHMARKS.md, fifteenth session)."""
    block_n = 64
    block_k, stages = _fit_pipeline(m, block_n, 128, dtype, device, max_stages=4)
    splits = max(1, min(4, num_sms(device) // triton.cdiv(n, block_n)))
    return block_n, block_k, stages, splits


def gemv_method(m: int, n: int, k: int) -> str | None:
    """Which kernel runs an (M, K) x (N, K)^T matmul fastest on an H100 (bf16, CUDA-graph
    replays, BENCHMARKS.md): "stream" for one row, and for two rows of W with N <= K (attention
    out, down: 4-30% over the dot kernel) or of a 7-8B model's qkv (H200: 5% over cuBLAS);
    "dot" for the rest up to MAX_ROWS rows, 1-40% over cuBLAS at Qwen3-0.6B to Llama-3.1-8B
    shapes, and up to MAX_DOT_ROWS for W with N >= WIDE_N (48-64 rows: gate_up 2-4%, LM heads
    5-7% over cuBLAS); "split" (split-K dot) for down projections (K > 2N) up to MAX_SPLIT_ROWS
    rows, 2-26% over cuBLAS; None (cuBLAS) for the rest."""
    # qkv at two rows, H200, MiMo-7B: stream 15.9 us, cuBLAS 16.7, dot 18.0 (thirtieth session)
    if m == 1 or (m == 2 and (n <= k or (k >= LARGE_K and n < WIDE_N))):
        return "stream"
    if m <= MAX_ROWS or (m <= MAX_DOT_ROWS and n >= WIDE_N):
        return "dot"
    return "split" if m <= MAX_SPLIT_ROWS and k > 2 * n else None


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """x (M, K) with M <= MAX_DOT_ROWS (MAX_SPLIT_ROWS for "split"), weight (N, K) -> (M, N) in x's
    dtype, or float32 into a float32 `out` (rounded once, from the float32 sum), + bias (N,).
    `method`: "stream", "dot" or "split" (default: `gemv_method`'s choice, or "stream" for a
    prologue).

    Prologues (stream only) fuse the op that feeds a decode matmul, saving a launch and a pass:
    `norm=(norm_weight (K,), eps)` multiplies RMSNorm(x + residual) instead of x and writes
    x + residual to `residual_out` (must not alias x or residual); `gated=True` takes x as
    [gate | up] (M, 2K) and multiplies silu(gate) * up. `block_n`, `block_k`, `num_warps`,
    `num_stages`, `num_splits` (split only) override the tuned configuration."""
    check(x.dim() == 2 and weight.dim() == 2, "x must be (M, K), W (N, K)")
    (m, kx), (n, k) = x.shape, weight.shape
    check(kx == (2 * k if gated else k), f"x has {kx} columns, W {k}" + (" (x2: gated)" * gated))
    if method is None:  # a prologue streams; cuBLAS's shapes: the row check below says so
        method = "stream" if gated or norm is not None else gemv_method(m, n, k) or "dot"
    max_rows = MAX_SPLIT_ROWS if method == "split" else MAX_DOT_ROWS
    check(1 <= m <= max_rows, f"gemv {method} is for 1..{max_rows} rows, got {m}")
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
    check(method in ("stream", "dot", "split"), f"unknown method {method!r}")
    check(method != "stream" or m <= MAX_STREAM_ROWS, f"stream is for 1..{MAX_STREAM_ROWS} rows")
    check(method == "stream" or not prologue, f"{method} has no prologue")
    args = (x, weight, out)
    sizes = (m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    if method == "stream":
        cfg_n, cfg_k = stream_config(m, n, k, x.device, prologue)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        stages = num_stages or stream_stages(m, k, block_n, block_k, x.element_size(), x.device)
        _gemv_stream_kernel[(triton.cdiv(n, block_n),)](
            *args, bias if bias is not None else x, *sizes,
            norm_w, res, res_out, eps, res.stride(0), res_out.stride(0),
            BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
            ONE_TILE=k <= block_k, PROLOGUE=prologue, HAS_RES=residual is not None,
            HAS_BIAS=bias is not None, LOOP_STAGES=stages, num_warps=num_warps, **pdl(x.device),
        )  # fmt: skip
    elif method == "dot":
        cfg_n, cfg_k, cfg_stages = dot_config(m, n, k, x.dtype, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        _gemv_dot_kernel[(triton.cdiv(n, block_n), 1)](
            x, weight, out, bias if bias is not None else x, m, n, k, k, x.stride(0),
            weight.stride(0), out.stride(0), BLOCK_M=max(16, next_pow2(m)),
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, SPLIT=False,
            HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps, num_stages=num_stages or cfg_stages, **pdl(x.device),
        )  # fmt: skip
    else:
        cfg_n, cfg_k, cfg_stages, splits = split_config(m, n, k, x.dtype, x.device)
        block_n, block_k = block_n or cfg_n, block_k or cfg_k
        per_split = triton.cdiv(triton.cdiv(k, num_splits or splits), block_k)
        per_split *= block_k  # whole tiles, so only the last split's last tile is partial
        splits = triton.cdiv(k, per_split)
        partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        _gemv_dot_kernel[(triton.cdiv(n, block_n), splits)](
            x, weight, partials, x, m, n, k, per_split, x.stride(0), weight.stride(0), n,
            BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, SPLIT=True, HAS_BIAS=False,
            PRECISION=dot_precision(x.dtype), UPCAST=is_interpreter(),
            num_warps=num_warps, num_stages=num_stages or cfg_stages, **pdl(x.device),
        )  # fmt: skip
        block = min(1024, next_pow2(n))
        _split_reduce_kernel[(m, triton.cdiv(n, block))](
            partials, out, bias if bias is not None else x, m, n, out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl(x.device),
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
