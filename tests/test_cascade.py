"""layers/cascade.py: the CPU path's cascade decode attention over shared KV blocks against
the torch reference (layers/attention.py), on caches whose unwritten slots hold NaN."""

from __future__ import annotations

import pytest
import torch

from tinyserve.model.layers import attention, cascade

BS, HKV, HQ, D = 16, 2, 8, 64
# (block table, context length): three sequences share 3 blocks; two share one (the block of
# the newest token is their own); two share a first block, then diverge; one shares nothing;
# one fits in a block.
SEQS = [
    ([1, 2, 3, 10], 53),
    ([1, 2, 3, 11, 12], 65),
    ([1, 2, 3, 13, 14, 15], 81),
    ([4, 16], 20),
    ([4, 17], 32),
    ([5, 6, 18], 40),
    ([5, 7, 19], 35),
    ([8, 20, 21], 40),
    ([9], 9),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _cache_and_metadata(seqs, query_lens, dtype):
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(24, BS, HKV, D, generator=gen).to(dtype) for _ in range(2))
    table = torch.zeros(len(seqs), 6, dtype=torch.int32)
    written = torch.zeros(24, BS, dtype=torch.bool)
    for i, (blocks, n) in enumerate(seqs):
        table[i, : len(blocks)] = torch.tensor(blocks)
        for p in range(n):
            written[blocks[p // BS], p % BS] = True
    k_cache[~written], v_cache[~written] = float("nan"), float("nan")  # a stray read shows
    lens = [n for _, n in seqs]
    md = attention.AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        query_lens_cpu=query_lens,
        context_lens_cpu=lens,
        max_context_len=max(lens),
        is_decode_only=all(n == 1 for n in query_lens),
    )
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, md


def _groups(md):
    return [(rows, len(slots) // BS) for rows, slots in md.shared_groups]


def _close(out, ref, dtype):
    assert torch.isfinite(out).all()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attends_each_groups_shared_blocks_once(dtype):
    """Decode rows: groups of 3 blocks, 1 block, and 1 block before diverging; lone rows and a
    one-block row attend all their keys; the reference's output."""
    q, k_cache, v_cache, md = _cache_and_metadata(SEQS, [1] * len(SEQS), dtype)
    out = cascade.decode(q, k_cache, v_cache, md, 0.1)
    assert _groups(md) == [([0, 1, 2], 3), ([3, 4], 1), ([5, 6], 1)]
    _close(out, attention.decode_attention_ref(q, k_cache, v_cache, md, 0.1), dtype)


def test_no_shared_block_runs_the_reference():
    """Nothing shared, or no host context lengths: None, so the layer runs the reference."""
    seqs = [SEQS[i] for i in (0, 3, 5, 7, 8)]
    q, k_cache, v_cache, md = _cache_and_metadata(seqs, [1] * 5, torch.float32)
    assert cascade.decode(q, k_cache, v_cache, md, 0.1) is None and md.shared_groups == []
    q, k_cache, v_cache, md = _cache_and_metadata(SEQS, [1] * len(SEQS), torch.float32)
    md.context_lens_cpu = []  # an MTP drafting chain's step: no host lengths
    assert cascade.decode(q, k_cache, v_cache, md, 0.1) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_attends_shared_blocks_once(dtype):
    """Decode rows and prompt chunks in one step: chunks whose cached blocks start alike (3
    blocks; 1 block, then diverging) attend them once per group, causal over their own keys;
    decode rows sharing a block take the decode cascade; a lone decode row, a lone chunk and a
    fresh prompt attend all their keys alone. The per-sequence reference's output."""
    lens = [1, 12, 20, 1, 1, 5, 3, 7, 9]
    q, k_cache, v_cache, md = _cache_and_metadata(SEQS, lens, dtype)
    out = attention.mixed_attention_cpu(q, k_cache, v_cache, md, 0.1)
    groups, shape, *_, keep, rest = md.prefill_cascade
    assert shape == (4, 20) and len(keep) == 12 + 20 + 5 + 3  # chunks padded to 20 tokens
    assert [(pos, len(slots) // BS) for pos, slots in groups] == [((0, 2), 3), ((2, 4), 1)]
    assert rest == [7, 8] and md.decode_rows[0] == [0, 3, 4]
    assert _groups(md.decode_rows[2]) == [([1, 2], 1)]  # rows 3 and 4 of the step
    _close(out, attention.prefill_attention_ref(q, k_cache, v_cache, md, 0.1), dtype)


def test_mixed_step_without_sharing_runs_the_reference():
    """No chunk shares a cached block with another: every row attends alone, as the reference."""
    seqs = [SEQS[i] for i in (0, 3, 5, 7, 8)]
    q, k_cache, v_cache, md = _cache_and_metadata(seqs, [1, 4, 6, 1, 9], torch.float32)
    out = attention.mixed_attention_cpu(q, k_cache, v_cache, md, 0.1)
    assert md.prefill_cascade == () and md.decode_rows[2] is not None
    assert torch.equal(out, attention.prefill_attention_ref(q, k_cache, v_cache, md, 0.1))
