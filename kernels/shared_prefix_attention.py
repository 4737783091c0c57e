"""Shared-prefix (cascade) decode attention: the prefix slots of `decode_attention`'s partials.

Shared prefixes (cascade attention): rows whose contexts start with the same KV blocks (prefix-
cache hits) can attend to those blocks together. `shared_chunks` (C, 1 + R) int32 lists a
leader row, whose table holds the prefix, then up to R member rows (-1 padded; all -1: an
unused chunk); `shared_lens` (B,) int32 is how many leading tokens of each row its chunk covers
(0: none). One program per (chunk, kv head, prefix split) reads a tile of the prefix once for
every member's query heads (a tensor-core tile of up to 64 query rows), instead of once per row;
the per-row kernel then reads only the rest of each context, and the merge combines both. On
512 rows sharing 2k-token prompts in groups of 32, per-row reads are L2-bandwidth bound at ~2x
the KV actually stored.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check, dot_precision, is_interpreter, pdl, pdl_sync
from .attention_tiles import _attend_tile, _kv_slots, _kv_tile

SHARED_BLOCK_M = 64  # query rows (member rows x query heads per kv head) of a shared-prefix tile


def shared_prefix_rows(num_heads: int, num_kv_heads: int) -> int:
    """Member rows per shared-prefix chunk (R): as many as fill one tile of query rows; 0 where
    one row's query heads per kv head do not fit a tile (no shared-prefix path)."""
    return SHARED_BLOCK_M // (num_heads // num_kv_heads)


@triton.jit
def _shared_prefix_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, chunks_ptr, skip_ptr, part_ptr, lse_ptr,
    scale_log2e, num_heads, total_splits,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_c,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (chunk, kv head, split): the chunk's members' query heads of this kv head (up to
    BLOCK_M = ROWS * GROUP query rows) against one split of the prefix in the leader's table."""
    pdl_sync(USE_PDL)
    c = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    leader = tl.load(chunks_ptr + c * stride_c)
    prefix_len = tl.where(leader >= 0, tl.load(skip_ptr + tl.maximum(leader, 0)), 0)
    split_len = tl.cdiv(tl.cdiv(prefix_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    m = tl.arange(0, BLOCK_M)
    member = m // GROUP
    heads = kv_head * GROUP + m % GROUP
    rows = tl.load(chunks_ptr + c * stride_c + 1 + member, mask=member < ROWS, other=-1)
    valid = rows >= 0  # an unused chunk is all -1
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + tl.maximum(leader, 0) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n, n_mask, block_ids, offs = _kv_slots(bt_row, n0, end, BLOCK_SIZE, BLOCK_N)
        k, v = _kv_tile(k_base, v_base, block_ids, offs, n_mask, d,
                        stride_kb, stride_ks, stride_vb, stride_vs)
        # One query a row: no causal mask, so n stands in for the last keys.
        m_i, l_i, acc = _attend_tile(q, k, v, n, n_mask, n, m_i, l_i, acc, scale_log2e,
                                     1, PRECISION, UPCAST)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    row = (rows * num_heads + heads) * total_splits + split
    tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
             mask=valid[:, None])
    tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=valid)


def shared_prefix_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    shared_chunks: torch.Tensor,
    shared_lens: torch.Tensor | None,
    scale: float,
    part: torch.Tensor,
    lse: torch.Tensor,
    *,
    num_splits: int,
    block_n: int,
) -> None:
    """Check the shared-prefix inputs, then attend each chunk's prefix in `num_splits` splits
    into slots [0, num_splits) of part (B, Hq, S, D) and lse (B, Hq, S), float32, S the step's
    splits in all; `decode_attention`'s per-row kernel fills the rest and its merge sums them.
    That launcher, the only caller, has checked q, the caches and block_tables."""
    num_heads, head_dim = q.shape[1:]
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = block_tables.shape[0]
    rows = shared_prefix_rows(num_heads, num_kv_heads)
    check(rows > 0, f"shared prefixes need Hq / Hkv <= {SHARED_BLOCK_M}")
    check(shared_lens is not None, "shared_chunks needs shared_lens")
    check(shared_chunks.dtype == torch.int32 and shared_chunks.dim() == 2
          and shared_chunks.shape[1] == 1 + rows and shared_chunks.stride(1) == 1,
          f"shared_chunks must be (C, {1 + rows}) int32")
    check(shared_lens.dtype == torch.int32 and shared_lens.shape == (batch,)
          and shared_lens.is_contiguous(), "shared_lens must be (B,) int32")
    check(num_splits >= 1, "shared_splits must be >= 1")
    if shared_chunks.shape[0] == 0:
        return
    _shared_prefix_kernel[(shared_chunks.shape[0], num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, shared_chunks, shared_lens, part, lse,
        scale * math.log2(math.e), num_heads, lse.shape[2],
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), shared_chunks.stride(0),
        GROUP=num_heads // num_kv_heads, ROWS=rows, BLOCK_M=SHARED_BLOCK_M, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        PRECISION=dot_precision(q.dtype), UPCAST=is_interpreter(),
        num_warps=4, num_stages=2, **pdl(q.device),
    )
