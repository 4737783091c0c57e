"""The paged prefill-attention kernel (mixed batches, key splits) and its tile and split
rules, against the torch reference."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    BF16,
    DEVICE,
    DTYPES,
    F32,
    assert_rel,
    gpu,
    needs_triton,
    paged_cache,
    poisoned,
    randn,
)

from tinyserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


# (Hq, Hkv, head_dim, block_size): decode rows, a prefill with a cached prefix, a fresh prompt.
PREFILL_CASES = [(4, 4, 64, 16), (8, 2, 128, 1), (8, 1, 64, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention_mixed_batch(dtype, case):
    num_heads, num_kv_heads, head_dim, block_size = case
    query_lens, lens = [1, 21, 5, 1], [9, 33, 5, 1]  # decode, extend, prompt, first token
    k_cache, v_cache, table, context_lens = paged_cache(
        4, lens, num_kv_heads, head_dim, block_size, dtype
    )
    cu = torch.tensor([0, 1, 22, 27, 28], dtype=torch.int32, device=DEVICE)
    q = randn(28, num_heads, head_dim, dtype=dtype)
    out = poisoned(q)
    prefill_attention(q, k_cache, v_cache, table, cu, context_lens, max(query_lens), 0.1, out)
    ref = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1)
    assert_rel(out, ref, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_prefill_attention_key_splits(dtype, num_splits):
    """Key splits merge to the one-pass result: splits that end inside the causal (masked) part,
    splits a row sees no key of, empty splits of short rows, and rows past the last sequence
    (zeroed)."""
    query_lens, lens = [1, 40, 3, 6], [70, 100, 3, 6]  # decode, extend, prompt, short prompt
    k_cache, v_cache, table, context_lens = paged_cache(4, lens, 2, 64, 16, dtype)
    cu = torch.tensor([0, 1, 41, 44, 50], dtype=torch.int32, device=DEVICE)
    q = randn(52, 8, 64, dtype=dtype)  # two rows past cu[-1]
    out = poisoned(q)
    prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        cu,
        context_lens,
        max(query_lens),
        0.1,
        out,
        num_splits=num_splits,
    )
    ref = prefill_attention_ref(q[:50], k_cache, v_cache, table, cu, context_lens, 0.1)
    assert_rel(out[:50], ref, dtype)
    assert torch.equal(out[50:], torch.zeros_like(out[50:]))


def test_prefill_num_splits_fills_the_sms_once_for_long_lone_tiles(monkeypatch):
    from tinyserve.kernels import prefill_attention as pa

    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "shared_memory", lambda device: 232448)  # an H100's
    cuda = torch.device("cuda")
    # 64 decode rows + a 48-token chunk at 32k keys (qwen3-0.6b heads; 64 x 64 tiles of 32
    # queries, two programs an SM): 16 long programs, cut 10 ways (264 programs at most)
    assert pa.prefill_num_splits([1] * 64 + [48], [600] * 64 + [32768], 16, 8, cuda) == 10
    # a 448-token chunk at 32k: 112 long programs, fewer splits
    assert pa.prefill_num_splits([1] * 64 + [448], [600] * 64 + [32768], 16, 8, cuda) == 2
    # one chunk, llama-3.1-8b heads: the counts the H100 sweep found best for each tile
    assert pa.prefill_num_splits([128], [32768], 32, 8, cuda) == 4  # 64 x 64: 64 tiles
    assert pa.prefill_num_splits([256], [32768], 32, 8, cuda) == 2  # 128 x 128: 64 tiles
    assert pa.prefill_num_splits([512], [32768], 32, 8, cuda) == 1  # 128 tiles, one an SM
    # short contexts never split, nor a tile set that fills the GPU, nor the CPU
    assert pa.prefill_num_splits([48], [1500], 16, 8, cuda) == 1
    assert pa.prefill_num_splits([8192], [8192], 16, 8, cuda) == 1
    assert pa.prefill_num_splits([48], [32768], 16, 8, torch.device("cpu")) == 1


def test_prefill_tile_is_tall_only_for_one_long_chunk_that_fits():
    from tinyserve.kernels.prefill_attention import prefill_tile

    h100, small = 232448, 101376  # bytes of shared memory a program may opt into
    assert prefill_tile(1, 4096 * 2, torch.bfloat16, h100) == (128, 128, 8, 3)  # the lane's
    assert prefill_tile(1, 448 * 2, torch.bfloat16, h100) == (128, 128, 8, 3)
    assert prefill_tile(1, 895, torch.bfloat16, h100) == (64, 64, 4, 3)  # a short chunk
    assert prefill_tile(65, 8192, torch.bfloat16, h100) == (64, 64, 4, 3)  # decode rows too
    assert prefill_tile(1, 8192, torch.float32, h100) == (64, 64, 4, 2)  # no room: 2 stages
    assert prefill_tile(1, 8192, torch.bfloat16, small) == (64, 64, 4, 3)


def test_prefill_tiles_lists_every_tile_a_launch_can_take(monkeypatch):
    from tinyserve.kernels import prefill_attention as pa

    cuda = torch.device("cuda")
    monkeypatch.setattr(pa, "shared_memory", lambda device: 232448)
    assert pa.prefill_tiles(torch.bfloat16, cuda) == {(64, 64, 4, 3), (128, 128, 8, 3)}
    assert pa.prefill_tiles(torch.float32, cuda) == {(64, 64, 4, 2)}
    monkeypatch.setattr(pa, "shared_memory", lambda device: 101376)
    assert pa.prefill_tiles(torch.bfloat16, cuda) == {(64, 64, 4, 3)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_prefill_attention_gpu(dtype):
    query_lens, lens = [1, 512, 37, 1000, 1, 300], [2000, 1024, 37, 3000, 5, 300]
    k_cache, v_cache, table, context_lens = paged_cache(6, lens, 8, 128, 16, dtype)
    cu = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = randn(sum(query_lens), 32, 128, dtype=dtype)
    out = poisoned(q)
    prefill_attention(q, k_cache, v_cache, table, cu, context_lens, 1000, 128**-0.5, out)
    assert_rel(
        out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 128**-0.5), dtype
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("block_m", "block_n", "num_warps"), [(64, 64, 4), (128, 128, 8)])
def test_prefill_attention_gpu_configs(block_m, block_n, num_warps):
    lens = [900, 1500, 129]  # query lengths 1, 700, 129: decode, extend, fresh
    k_cache, v_cache, table, context_lens = paged_cache(3, lens, 8, 128, 16, BF16)
    cu = torch.tensor([0, 1, 701, 830], dtype=torch.int32, device=DEVICE)
    q = randn(830, 32, 128, dtype=BF16)
    out = poisoned(q)
    prefill_attention(
        q,
        k_cache,
        v_cache,
        table,
        cu,
        context_lens,
        700,
        0.1,
        out,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
    )
    assert_rel(out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "chunk"), [(16, 48), (16, 448), (32, 48), (32, 128)])
def test_prefill_attention_key_splits_gpu(heads, chunk):
    """64 decode rows beside a chunk of a 32k-token prompt, with the split count the engine
    picks (query groups of 2, qwen3-0.6b, and 4, llama-3.1-8b: 10, 2, 7 and 3 splits)."""
    from tinyserve.kernels.prefill_attention import prefill_num_splits

    query_lens, lens = [1] * 64 + [chunk], [600] * 64 + [32768]
    k_cache, v_cache, table, context_lens = paged_cache(65, lens, 8, 128, 16, BF16)
    cu = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    q = randn(sum(query_lens), heads, 128, dtype=BF16)
    splits = prefill_num_splits(query_lens, lens, heads, 8, q.device)
    assert splits > 1
    out = poisoned(q)
    prefill_attention(
        q, k_cache, v_cache, table, cu, context_lens, chunk, 128**-0.5, out, num_splits=splits
    )
    ref = prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 128**-0.5)
    assert_rel(out, ref, BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [64, 128])
def test_prefill_attention_reads_nothing_for_zero_contexts_gpu(block_m):
    """A CUDA graph's warm-up runs on zeroed buffers: context lengths 0 under long queries
    must read no table entry before the row (an illegal address before the guard, seen with
    128-row tiles)."""
    lens = [2304, 128, 1500]
    k_cache, v_cache, table, _ = paged_cache(3, lens, 8, 128, 16, BF16)
    cu = torch.tensor([0, 256, 384, 1084], dtype=torch.int32, device=DEVICE)
    q = randn(1084, 16, 128, dtype=BF16)
    zero = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    prefill_attention(
        q, k_cache, v_cache, table, cu, zero, 700, 128**-0.5, block_m=block_m, block_n=32
    )
    torch.cuda.synchronize()  # an illegal address would raise here
