"""gemv_config: which kernel a (rows, N, K) product takes and its tile, stages and split
count, on stand-in devices (SM count and shared memory patched)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import needs_triton

import tinyserve.kernels.gemv_config as gemv_config
from tinyserve.kernels._common import next_pow2
from tinyserve.kernels.gemv_config import (
    dot_config,
    gemv_method,
    silu_mul_epilogue,
    split_config,
    stream_config,
    stream_stages,
)

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


def test_gemv_method_and_dot_config(monkeypatch):
    """One row streams; two rows stream only W with N <= K (attention out, down) and a 7-8B
    model's qkv (K >= 4096, N < WIDE_N); the rest up to 32 rows take the dot kernel, and above
    cuBLAS, but for wide W, a 7-8B model's attention and down projections. The dot tile is the
    widest that gives every other SM a program, with as many stages as shared memory holds (at
    most 5), or more where a program would not hold its SM alone."""
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: False)  # an H100 or H200 differs below
    assert gemv_method(1, 151936, 1024) == gemv_method(2, 4096, 11008) == "stream"
    assert gemv_method(2, 6144, 4096) == "stream" and gemv_method(3, 6144, 4096) == "dot"
    assert gemv_method(4, 4096, 4096) == gemv_method(8, 22016, 4096) == "dot"  # o, gate_up
    assert gemv_method(4, 6144, 1024) == gemv_method(4, 3072, 2048) == "dot"
    assert gemv_method(2, 4096, 1024) == gemv_method(2, 22016, 4096) == "dot"  # small K, wide N
    assert gemv_method(2, 151936, 4096) == gemv_method(16, 4096, 11008) == "dot"
    assert gemv_method(32, 1024, 1024) == "dot" and gemv_method(33, 1024, 1024) is None
    # 33..64 rows: dot for wide W only (gate_up of 1B-8B models, LM heads).
    assert gemv_method(48, 22016, 4096) == gemv_method(64, 151936, 1024) == "dot"
    assert gemv_method(65, 151936, 1024) is None and gemv_method(48, 6144, 4096) is None
    # ...and for a 7-8B model's attention (K >= 4096): split-K for attention out (N <= K < 2N)
    # to 128 rows and the dot kernel for qkv at 49-64 rows, where cuBLAS slows.
    assert gemv_method(33, 4096, 4096) == gemv_method(128, 4096, 4096) == "split"
    assert gemv_method(49, 6144, 4096) == gemv_method(64, 6144, 4096) == "dot"
    assert gemv_method(64, 6144, 2048) is None and gemv_method(65, 6144, 4096) is None
    assert gemv_method(64, 1024, 1024) is None and gemv_method(129, 4096, 4096) is None
    # 33..128 rows: split-K for down projections (K > 2N); eh_proj (K = 2N) lost at 128.
    assert gemv_method(33, 1024, 3072) == gemv_method(128, 4096, 11008) == "split"
    assert gemv_method(64, 4096, 8192) is None and gemv_method(129, 4096, 11008) is None
    # On Hopper (132 SMs), a 7-8B gate_up (K >= 4096, WIDE_N <= N < HEAD_N) at 33-64 rows whose
    # 128-row tiles fill the last wave under 80% (MiMo's 22,016: 65%) takes the tma kernel,
    # with its SiLU epilogue; Llama-3.1-8B's 28,672 (85%), LM heads and small K do not.
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: True)
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    assert gemv_method(33, 22016, 4096) == gemv_method(64, 22016, 4096) == "tma"
    assert silu_mul_epilogue(48, 22016, 4096) and gemv_method(64, 28672, 4096) == "dot"
    assert gemv_method(32, 22016, 4096) == gemv_method(48, 22016, 2048) == "dot"
    assert gemv_method(48, 151936, 4096) == "dot" and gemv_method(65, 22016, 4096) is None
    monkeypatch.setattr(gemv_config, "_has_tma", lambda: False)
    assert gemv_method(64, 22016, 4096) == "dot"
    monkeypatch.undo()  # the interpreter's 4 SMs again
    h100 = torch.device("cpu")  # the interpreter stands in for 4 SMs and an H100's 227 KB
    assert dot_config(2, 1024, 1024, torch.bfloat16, h100)[:2] == (128, 128)
    assert dot_config(2, 128, 1024, torch.bfloat16, h100)[:2] == (64, 128)
    assert dot_config(2, 16, 1024, torch.bfloat16, h100)[:2] == (32, 256)
    stages = {
        (m, dt): dot_config(m, 1024, 1024, dt, h100)[2]
        for m in (2, 32)
        for dt in (torch.bfloat16, torch.float32)
    }
    assert stages == {
        (2, torch.bfloat16): 5,
        (32, torch.bfloat16): 5,
        (2, torch.float32): 3,
        (32, torch.float32): 2,
    }
    # A card with 99 KB of shared memory (consumer Ada): float32 at 32 rows halves BLOCK_K.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 101376)
    assert dot_config(32, 1024, 1024, torch.float32, h100)[:3] == (128, 64, 2)
    assert dot_config(2, 1024, 1024, torch.bfloat16, h100)[:3] == (128, 128, 2)
    # Split-K: 64 x 128 tiles; K split so the grid fills an H100's 132 SMs once, at most 4 ways.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 232448)
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    assert split_config(128, 4096, 11008, torch.bfloat16, h100) == (64, 128, 4, 2)
    assert split_config(64, 2048, 8192, torch.bfloat16, h100) == (64, 128, 5, 4)
    assert split_config(64, 1024, 3072, torch.bfloat16, h100) == (64, 128, 5, 4)
    assert split_config(64, 8192, 28672, torch.bfloat16, h100)[3] == 1
    # Up to 32 rows, wide W whose 128-row tiles leave the last wave under 80% full: two programs
    # an SM, 84 rows each in 128-row tiles (MiMo's gate_up: 172 programs of 128, a second wave on
    # 40 SMs). At 33-64 rows, 64-wide tiles where they fill the last wave better (344 of 64).
    assert dot_config(2, 22016, 4096, torch.bfloat16, h100) == (128, 64, 5, 84, 8)
    assert dot_config(32, 22016, 4096, torch.bfloat16, h100) == (128, 64, 5, 84, 8)
    assert dot_config(16, 28672, 4096, torch.bfloat16, h100)[3] == 128  # 85% full
    assert dot_config(64, 22016, 4096, torch.bfloat16, h100) == (64, 128, 5, 64, 4)
    assert dot_config(64, 28672, 4096, torch.bfloat16, h100) == (128, 128, 4, 128, 4)  # a tie
    assert dot_config(64, 151936, 1024, torch.bfloat16, h100)[:4] == (128, 128, 4, 128)  # a head
    # Programs that would fit two to an SM hold more stages, so that one holds it alone (less
    # one stage: Triton's mma v2 pipeline keeps stages - 1 tiles): MiMo's attention out and
    # down at 16 rows, 128 programs of 32 x 256 (24 KB a stage); qkv, 96 of 64 x 128 (20 KB).
    for n, k, tile in (
        (4096, 4096, (32, 256, 6)),
        (4096, 11008, (32, 256, 6)),
        (6144, 4096, (64, 128, 7)),
    ):
        assert dot_config(16, n, k, torch.bfloat16, h100)[:3] == tile
        assert (tile[2] - 1) * (tile[0] + 16) * tile[1] * 2 > 232448 // 2


def test_stream_config_gated_tiles():
    """Above one row, the gated prologue's tile is 8 W rows and 8K products a step (the single-
    row rule's 4 x 4096 x 2 spilled registers: BENCHMARKS.md). One row keeps at least 4 W rows
    a program, the norm prologue at least 8."""
    cpu = torch.device("cpu")
    for n, k in [(1024, 3072), (4096, 11008), (4096, 14336)]:
        for m in (2, 3, 4):
            block_n, block_k = stream_config(m, n, k, cpu, prologue=2)
            assert block_n == 8 and next_pow2(m) * block_n * block_k == 8192
        assert stream_config(1, n, k, cpu, prologue=2)[0] >= 4  # more for a large N
        assert stream_config(1, n, k, cpu, prologue=1)[0] >= 8


def test_stream_config_one_row_tiles(monkeypatch):
    """One row, H100 (132 SMs): the norm prologue takes K <= 1024 in one tile (fetched before
    the PDL wait); LM heads take 8 x 1024 tiles; a small N keeps 2 W rows a program, except
    under a prologue, where the down projection keeps its one 4 x 4096 tile."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(1, 6144, 1024, h100, prologue=1) == (8, 1024)  # Qwen3-0.6B gate_up
    assert stream_config(1, 3072, 2048, h100, prologue=1) == (8, 1024)  # Llama-3.2-1B: 2 tiles
    assert stream_config(1, 151936, 1024, h100) == (8, 1024)
    assert stream_config(1, 128256, 4096, h100) == (8, 1024)
    assert stream_config(1, 1024, 2048, h100) == (2, 2048)  # Qwen3-0.6B attention out
    assert stream_config(1, 1024, 3072, h100, prologue=2) == (4, 4096)  # its down


def test_stream_config_two_row_tiles(monkeypatch):
    """Two rows keep one row's 4K products a step, or at K >= 4096 take 16 x 512 tiles (N <= K:
    MiMo-7B's attention out and eh_proj) or 4 x 256 (its qkv); more rows 8K; the gated prologue
    keeps its 8-row tiles."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(2, 4096, 4096, h100) == stream_config(2, 4096, 8192, h100) == (16, 512)
    assert stream_config(2, 6144, 4096, h100) == (4, 256)  # MiMo-7B's qkv
    assert stream_config(2, 1024, 2048, h100) == (1, 2048)  # Qwen3-0.6B's attention out
    assert stream_config(4, 4096, 4096, h100) == (4, 512)
    assert stream_config(1, 4096, 4096, h100) == (4, 1024)
    assert stream_config(2, 4096, 11008, h100, prologue=2) == (8, 512)


def test_stream_stages_pipeline_long_loops(monkeypatch):
    """A stream program pipelines its W tiles (3 in flight) once it loops over 16 or more:
    MiMo-7B / Llama-3.1-8B gate_up at one row (16 x 256 tiles over K = 4096), gated down at two
    (8 x 512 over 11,008); short loops (attention out at one row: 4 tiles) fetch one at a time."""
    monkeypatch.setattr(gemv_config, "num_sms", lambda device: 132)
    h100 = torch.device("cpu")
    assert stream_config(1, 22016, 4096, h100) == (16, 256)
    bf16 = 2
    assert stream_stages(1, 4096, 16, 256, bf16, h100) == 3
    assert stream_stages(2, 11008, 8, 512, bf16, h100) == 3
    assert stream_stages(2, 4096, 16, 512, bf16, h100) == 3  # two rows at K >= 4096
    assert stream_stages(1, 4096, 4, 1024, bf16, h100) == 1  # 4 tiles
    assert stream_stages(1, 11008, 4, 1024, bf16, h100) == 1  # 11 tiles
    assert stream_stages(1, 8192, 4, 1024, bf16, h100) == 1  # 8 tiles
    assert stream_stages(2, 2048, 2, 1024, bf16, h100) == 1  # two rows, K < 4096
    # 3 float32 stages of 16 x 512 (141 KB) do not fit a 99 KB consumer card; bf16 (71 KB) do.
    monkeypatch.setattr(gemv_config, "shared_memory", lambda device: 101376)
    assert stream_stages(2, 4096, 16, 512, 4, h100) == 1
    assert stream_stages(2, 4096, 16, 512, bf16, h100) == 3
