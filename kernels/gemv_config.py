"""Which kernel and tiles a decode matmul takes (`gemv.py` runs them): `gemv_method` picks the
stream kernel, the dot kernel, its split-K form or cuBLAS for an (M, K) x (N, K)^T shape, and the
`*_config` / `stream_stages` functions pick tiles and pipeline depth. Each rule is the fastest
found in bf16 CUDA-graph replays and engine steps (BENCHMARKS.md, kernels; docs/benchmark-log.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from ._common import next_pow2, num_sms, shared_memory

# The dot kernel's for any W: past it cuBLAS wins alone (by up to 29% at 48-64 rows); in the
# step some 33-64-row shapes still gain from it or from split-K (`gemv_method`).
MAX_ROWS = 32
WIDE_N = 16384  # ...but for W this wide (gate_up of 1B-8B models, LM heads) it wins to 64 rows
HEAD_N = 32768  # W this wide is an LM head (or a 32k draft head)
LARGE_K = 4096  # 7-8B models' hidden size: they have few-row rules of their own
MAX_DOT_ROWS = 64  # x is one tile of at most this many rows
MAX_SPLIT_ROWS = 128  # the split-K form's, for down projections (tried up to 128 rows)
MAX_STREAM_ROWS = 16  # the stream kernel keeps an (M, BLOCK_N, BLOCK_K) fp32 accumulator
# A 7-8B model's qkv (K >= 4096, K < N < WIDE_N) at 33-64 rows stays on cuBLAS up to this many
# rows: the dot kernel runs a 64-row x tile at 33-64 rows alike, cuBLAS gets slower past 48.
CUBLAS_QKV_ROWS = 48


def stream_config(m: int, n: int, k: int, device: torch.device, prologue: int = 0
                  ) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): ~4 programs per SM (1 row each when N is small), 8 KB of W a step.
    A prologue (1: norm, 2: gated) reads x in every program, so each takes more W rows."""
    block_m = next_pow2(m)
    if prologue == 2 and m > 1:  # all of x (M x 2K) a program: 8 W rows, 8K products a step.
        # Faster at M = 2 (3x where the rule below's 4 x 4096 tile spills). At M = 1 it is
        # faster alone but 3% slower end to end, so M = 1 keeps the rule below.
        return 8, min(next_pow2(k), 8192 // (8 * block_m))
    if block_m == 2 and k >= LARGE_K and not prologue:  # 7-8B models' attention in / out
        # With 3 stages (`stream_stages`): 16 x 512 is 5% faster than 4 x 512; qkv's 4 x 256
        # beats cuBLAS by 5%.
        return (16, 512) if n <= k else (4, 256)
    if block_m == 1 and n >= HEAD_N:  # LM heads: 1-2% faster than 16 x 256
        return 8, min(next_pow2(k), 1024)
    # One row, no prologue: at least 2 W rows a program (9% faster at Qwen3-0.6B's attention
    # out). Not with a prologue: its down projection's 1 x 4096 step (one tile) would halve.
    block_n = 2 if block_m == 1 and not prologue else 1
    while block_n < 16 and triton.cdiv(n, 2 * block_n) >= 4 * num_sms(device):
        block_n *= 2
    # 4K products a step for one or two rows (7-11% faster than 8K at MiMo-7B's 4k-wide W).
    per_step = 4096 // (block_m * block_n) if block_m <= 2 else 8192 // (block_m * block_n)
    block_k = min(next_pow2(k), max(64, per_step))
    if prologue:  # rows per program: best at 4 (gated) / 8 (norm)
        block_n = max(block_n, 4 if prologue == 2 else 8)
        if block_n * next_pow2(k) <= 8192:  # one tile, fetched before the PDL wait (below):
            block_k = next_pow2(k)  # Qwen3-0.6B's gate_up: 20% faster than 8 x 512
    return block_n, block_k


def stream_stages(m: int, k: int, block_n: int, block_k: int, itemsize: int,
                  device: torch.device) -> int:
    """W tiles a stream program keeps in flight: 3 (2 fetched ahead, through shared memory) once
    it loops over 16 or more K tiles, or for two rows at K >= 4096; else 1 (fetch, then use).
    Those loops gain 8-16%; short loops at one row gain nothing or lose 6%. Without the loop's
    own stage count Triton pipelines only the loads that feed a tl.dot, so this kernel's never
    were. The 3 stages of W and x tiles (x: up to 3 rows' worth per row, for [gate | up] and a
    residual) must fit in shared memory: float32 16 x 512 tiles do not on a ~100 KB consumer
    card."""
    long_loop = triton.cdiv(k, block_k) >= 16 or (m == 2 and k >= LARGE_K)
    tiles = 3 * (block_n + 3 * next_pow2(m) + 1) * block_k * itemsize
    return 3 if long_loop and tiles <= shared_memory(device) else 1


class DotTiles(NamedTuple):
    block_n: int
    block_k: int
    stages: int
    rows: int  # W rows a program takes: block_n, or fewer (the rest of its tile masked off)
    warps: int


def x_tile(m: int) -> tuple[int, bool]:
    """(BLOCK_M, MASK_X) of the dot and split kernels for M rows of x: a tensor-core tile of at
    least 16 rows, and whether rows past M are masked (a kernel variant of its own)."""
    block_m = max(16, next_pow2(m))
    return block_m, m < block_m


def dot_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> DotTiles:
    """The widest W tile that still gives every other SM a program (128 x 128, 64 x 128 or 32 x
    256), as many stages in flight as shared memory holds, up to 5 (or more, so that a program
    holds an SM alone: `_fit_pipeline`): a deep pipeline over few programs streams W faster than
    many shallow ones (MiMo-7B's qkv: 1.7x over ~2 programs an SM and 4 stages). Wide W whose
    128-row tiles leave the last wave on few SMs: `_balanced`."""
    sms, block_n = num_sms(device), 128
    fill = _last_wave_fill(n, 128, sms)
    if m <= MAX_ROWS and WIDE_N <= n < HEAD_N and n <= 256 * sms and fill < 0.8:
        return _balanced(m, n, dtype, device)
    while block_n > 32 and triton.cdiv(n, block_n) < sms // 2:
        block_n //= 2
    if m > 8 and block_n == 128 and _last_wave_fill(n, 64, sms) > fill:
        # A 128-wide program holds an SM alone, so a last wave on few SMs streams its W slowly
        # (MiMo-7B's gate_up at 64 rows: 3% a step; `_balanced` rows lose there).
        block_n = 64
    block_k = 256 if block_n == 32 else 128
    block_k, stages = _fit_pipeline(m, block_n, block_k, dtype, device, max_stages=5)
    return DotTiles(block_n, block_k, stages, block_n, 4)


def _balanced(m: int, n: int, dtype: torch.dtype, device: torch.device) -> DotTiles:
    """Two programs an SM, one wave, each over an equal run of W rows (cdiv(N, 2 x SMs), its tile
    padded to a power of two with masked rows, which are never fetched), 64-wide K steps, as
    many stages as two programs' share of shared memory holds (at most 5), 8 warps. A 128-row
    tile gives MiMo-7B's gate_up (N = 22,016) 172 programs: a second wave on 40 of 132 SMs;
    this one is 1-6% faster there at 2-32 rows (4 warps or 4 stages lose). At 64 rows it wins
    alone but loses in the step, hence up to MAX_ROWS; a last wave over 80% full (Llama-3.1-8B's
    28,672) gains too little. At most 128 rows a program (N <= 256 x SMs)."""
    rows = triton.cdiv(n, 2 * num_sms(device))
    block_n, block_k = max(16, next_pow2(rows)), 64
    stage = (block_n + x_tile(m)[0]) * block_k * dtype.itemsize
    return DotTiles(block_n, block_k, max(2, min(5, shared_memory(device) // 2 // stage)), rows, 8)


def _last_wave_fill(n: int, block_n: int, sms: int) -> float:
    """The share of the SMs the grid's waves keep busy, one program an SM."""
    programs = triton.cdiv(n, block_n)
    return programs / (triton.cdiv(programs, sms) * sms)


def _fit_pipeline(m: int, block_n: int, block_k: int, dtype: torch.dtype, device: torch.device,
                  max_stages: int) -> tuple[int, int]:
    """(BLOCK_K, stages) of a dot tile: BLOCK_K halved until two stages of W and x tiles fit in
    shared memory (float32 at 32 rows on a 100 KB consumer card), then as many stages as fit,
    up to max_stages, and at least enough that one program holds over half of an SM's shared
    memory where they fit: no two programs of a grid share an SM.

    The 32- and 64-wide tiles and split-K make grids of about one program an SM or fewer, and
    under PDL a kernel's programs are placed while the kernel before it still runs, on the SMs
    that have room then. Where two fit on one SM they are stacked in pairs on part of the GPU,
    each pair streaming W at one SM's rate (MiMo-7B's batch-16 step: 7% slower). Triton holds
    stages - 1 tiles (mma v2, 32-wide W tiles) or stages (wgmma), hence the + 2."""
    smem, rows = shared_memory(device), x_tile(m)[0]
    while block_k > 32 and 2 * (block_n + rows) * block_k * dtype.itemsize > smem:
        block_k //= 2
    stage = (block_n + rows) * block_k * dtype.itemsize
    exclusive = smem // 2 // stage + 2
    return block_k, min(smem // stage, max(max_stages, exclusive))


def split_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, splits) of the split-K dot kernel: 64 x 128 W tiles, 4 stages (5
    at 64 rows: `_fit_pipeline`), K split in up to 4 so the grid fills the SMs once: 1-26% over
    cuBLAS (which splits K itself at 64 rows) at 0.6B-8B down projections, 64 and 128 rows."""
    block_n = 64
    block_k, stages = _fit_pipeline(m, block_n, 128, dtype, device, max_stages=4)
    splits = max(1, min(4, num_sms(device) // triton.cdiv(n, block_n)))
    return block_n, block_k, stages, splits


def tma_config(silu_mul: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, warps) of the tma kernel: 128 W rows a program (64 gate + 64 up
    rows with silu_mul), 64-wide K steps, 4 stages, one warpgroup (`gemv_tma`'s sweep)."""
    return (64 if silu_mul else 128), 64, 4, 4


_CUDA = torch.device("cuda")


@functools.lru_cache(maxsize=1)
def _has_tma() -> bool:
    """Whether the current CUDA device has tensor-memory copies (Hopper, sm_90, and later)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _tma_pays(m: int, n: int, k: int) -> bool:
    """The tma kernel for a 7-8B gate_up ([gate; up], K >= 4096, WIDE_N <= N < HEAD_N) at 33-64
    rows whose 128-row tiles leave the last wave under 80% full (as `_balanced`'s rule), on
    Hopper: steps 1% faster at MiMo-7B's N = 22,016 (65% full), 0-4% at Qwen3-8B's 24,576 (73%),
    though slower alone; Llama-3.1-8B's 28,672 (85%) tied, so it keeps the dot kernel."""
    if not (MAX_ROWS < m <= MAX_DOT_ROWS and WIDE_N <= n < HEAD_N and k >= LARGE_K):
        return False
    return _has_tma() and _last_wave_fill(n, 128, num_sms(_CUDA)) < 0.8


def gemv_method(m: int, n: int, k: int) -> str | None:
    """Which kernel runs an (M, K) x (N, K)^T matmul fastest (bf16, CUDA-graph replays):
    "stream" for one row, and for two rows of W with N <= K (attention out, down: 4-30% over the
    dot kernel) or of a 7-8B model's qkv (5% over cuBLAS); "dot" for the rest up to MAX_ROWS
    rows, 1-40% over cuBLAS at Qwen3-0.6B to Llama-3.1-8B shapes, and up to MAX_DOT_ROWS for W
    with N >= WIDE_N (48-64 rows: gate_up 2-4%, LM heads 5-7% over cuBLAS); "split" (split-K
    dot) for down projections (K > 2N) up to MAX_SPLIT_ROWS rows, 2-26% over cuBLAS; "tma"
    (`gemv_tma`, Hopper) in place of "dot" for some 7-8B gate_up at 33-64 rows (`_tma_pays`);
    for a 7-8B model (K >= LARGE_K), "split" for attention out (N <= K < 2N) at 33-128 rows and
    "dot" for qkv at CUBLAS_QKV_ROWS-64, where they beat cuBLAS in the step though not alone
    (PDL: a Triton kernel is placed, and fetches W, while the kernel before it runs; a cuBLAS
    one waits for it to end: steps up to 3% faster); None (cuBLAS) for the rest."""
    if m == 1 or (m == 2 and (n <= k or (k >= LARGE_K and n < WIDE_N))):
        return "stream"
    if _tma_pays(m, n, k):
        return "tma"
    if m <= MAX_ROWS or (m <= MAX_DOT_ROWS and n >= WIDE_N):
        return "dot"
    # A 7-8B model's attention out: even with cuBLAS alone at 80-128 rows, its sum then free in
    # the next norm.
    if k >= LARGE_K and n <= k < 2 * n and m <= MAX_SPLIT_ROWS:
        return "split"
    if m <= MAX_DOT_ROWS and k >= LARGE_K and k < n < WIDE_N and m > CUBLAS_QKV_ROWS:  # its qkv
        return "dot"
    return "split" if m <= MAX_SPLIT_ROWS and k > 2 * n else None


def silu_mul_epilogue(m: int, n: int, k: int) -> bool:
    """Whether a gate_up projection (W = [gate; up], (N, K)) at M rows computes silu(gate) * up
    in the dot or tma kernel's epilogue: wherever it runs one of them, above two rows (at one or two
    rows the down projection's stream prologue takes the SiLU)."""
    return m > 2 and gemv_method(m, n, k) in ("dot", "tma")


def norm_prologue_pays(k: int) -> bool:
    """Where gemv(norm=...) beats rms_norm + gemv at M = 1: K = 1024 (8-13% faster); at K = 4096
    the prologue's extra x / residual / weight reads per program cost more than the launch it
    saves (5-7% slower)."""
    return k <= 2048
