"""The attention layer over the Triton kernels: its torch oracles equal the kernels',
and a step's split plan (split count, key tile, split floor) reaches the decode kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, F32, assert_rel, needs_triton, paged_cache, randn

from tinyserve.kernels.decode_attention import decode_attention, decode_attention_ref
from tinyserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


def test_attention_match_layer_references():
    """The kernels' oracles and the layers' torch path agree (same head mapping, same mask)."""
    from tinyserve.model.layers.attention import AttentionMetadata
    from tinyserve.model.layers.attention import decode_attention_ref as layer_decode
    from tinyserve.model.layers.attention import prefill_attention_ref as layer_prefill

    lens, query_lens = [7, 30], [1, 12]
    k_cache, v_cache, table, context_lens = paged_cache(2, lens, 2, 64, 16, F32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    md = AttentionMetadata(
        slot_mapping=torch.zeros(13, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, 1, 13], dtype=torch.int32, device=DEVICE),
        context_lens=context_lens,
        query_lens_cpu=query_lens,
        context_lens_cpu=lens,
        max_context_len=max(lens),
        is_decode_only=False,
    )
    q = randn(13, 8, 64)
    out = prefill_attention(q, k_cache, v_cache, table, md.cu_seqlens_q, context_lens, 12, 0.1)
    assert_rel(out, layer_prefill(q, k_cache, v_cache, md, 0.1), F32)
    qd = randn(2, 8, 64)
    out = decode_attention(qd, k_cache, v_cache, table, context_lens, 0.1)
    assert_rel(out, layer_decode(qd, k_cache, v_cache, md, 0.1), F32)


def _layer_forward_recording_decode(monkeypatch, md, positions, k_cache, v_cache):
    """The Triton attention layer (8 query heads, 2 kv heads of 64) over random qkv at
    `positions` under metadata md: (output, qkv, keyword arguments of each decode-kernel call)."""
    from types import SimpleNamespace

    from tinyserve.model.layers import attention as layer

    rope = SimpleNamespace(
        positions=torch.tensor(positions, device=DEVICE), cos_sin_cache=randn(128, 64)
    )
    attn = layer.Attention(num_heads=8, head_dim=64, scale=0.1, num_kv_heads=2)
    attn.k_cache, attn.v_cache = k_cache, v_cache
    calls, kernel = [], layer.decode_attention
    monkeypatch.setattr(
        layer, "decode_attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw)
    )
    qkv = randn(len(positions), (8 + 2 * 2) * 64)
    with layer.forward_context(md):
        out = attn._forward_triton(qkv, rope, None, None)
    return out, qkv, calls


def test_attention_layer_hands_the_step_split_plan_to_the_kernel(monkeypatch):
    """A decode step's split count, key tile and split floor (graph_shapes.decode_num_splits and
    decode_tiling, in the metadata) reach the Triton decode kernel through the layer, with the
    oracle's output."""

    from tinyserve.model.layers import attention as layer

    lens, block_size = [40, 70], 16
    k_cache, v_cache, table, context_lens = paged_cache(2, lens, 2, 64, block_size, F32)
    last = [n - 1 for n in lens]
    slots = [
        int(table[b, p // block_size]) * block_size + p % block_size for b, p in enumerate(last)
    ]
    md = layer.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        context_lens=context_lens,
        query_lens_cpu=[1, 1],
        context_lens_cpu=lens,
        max_context_len=max(lens),
        is_decode_only=True,
        num_splits=4,
        decode_block_n=32,
        decode_min_split=64,
    )
    out, qkv, calls = _layer_forward_recording_decode(monkeypatch, md, last, k_cache, v_cache)
    assert [(c["num_splits"], c["block_n"]) for c in calls] == [(4, 32)]
    assert calls[0]["min_split_len"] == 64  # graph_shapes.decode_tiling's floor, too
    q = qkv[:, : 8 * 64].view(2, 8, 64)  # rotated in place by the layer
    assert_rel(out, decode_attention_ref(q, k_cache, v_cache, table, context_lens, 0.1), F32)


def test_mixed_step_hands_the_decode_rows_split_plan_to_the_kernel(monkeypatch):
    """A mixed step (decode rows, then one prompt chunk): the decode rows' split count, key
    tile and split floor reach the decode kernel, and the outputs are the oracle's."""

    from tinyserve.model.layers import attention as layer

    lens, block_size, chunk = [40, 70, 20], 16, 3
    k_cache, v_cache, table, context_lens = paged_cache(3, lens, 2, 64, block_size, F32)
    pos = [39, 69, *range(20 - chunk, 20)]
    rows = [0, 1] + [2] * chunk
    slots = [
        int(table[b, p // block_size]) * block_size + p % block_size for b, p in zip(rows, pos)
    ]
    cu = torch.tensor([0, 1, 2, 2 + chunk], dtype=torch.int32, device=DEVICE)
    md = layer.AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=table,
        cu_seqlens_q=cu,
        context_lens=context_lens,
        query_lens_cpu=[1, 1, chunk],
        context_lens_cpu=lens,
        max_context_len=0,
        is_decode_only=False,
        num_splits=4,
        decode_block_n=32,
        decode_min_split=64,
        chunk=(2, torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)),
    )
    out, qkv, calls = _layer_forward_recording_decode(monkeypatch, md, pos, k_cache, v_cache)
    assert [(c["num_splits"], c["block_n"], c["min_split_len"]) for c in calls] == [(4, 32, 64)]
    q = qkv[:, : 8 * 64].view(2 + chunk, 8, 64)  # rotated in place by the layer
    assert_rel(out, prefill_attention_ref(q, k_cache, v_cache, table, cu, context_lens, 0.1), F32)
