"""Tile steps shared by the paged decode kernels (decode_attention.py, shared_prefix_attention.py).

`_kv_slots` finds a key tile's slots through a block table, `_kv_tile` loads its K and V, and
`_attend_tile` folds it into a running online softmax. Jitted helpers only: no launcher, no op.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_slots(bt_row, n0, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys n = n0 + arange(BLOCK_N) below end: (n, mask, block ids, offsets in the block)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    if BLOCK_SIZE >= BLOCK_N:  # tiles are aligned, so the whole tile sits in one KV block
        block_ids = tl.load(bt_row + n0 // BLOCK_SIZE, mask=n0 < end, other=0).to(tl.int64)
    else:
        block_ids = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        block_ids = block_ids[:, None]
    return n, n_mask, block_ids, (n % BLOCK_SIZE)[:, None]


@triton.jit
def _kv_tile(k_base, v_base, block_ids, offs, mask, d,
             stride_kb, stride_ks, stride_vb, stride_vs):
    """(k, v) (BLOCK_N, D) at the slots; rows outside mask are 0 and never read (padding slots
    may hold never-written memory, NaN)."""
    k_ptrs = k_base + block_ids * stride_kb + offs * stride_ks + d[None, :]
    v_ptrs = v_base + block_ids * stride_vb + offs * stride_vs + d[None, :]
    mask = mask[:, None]
    return tl.load(k_ptrs, mask=mask, other=0.0), tl.load(v_ptrs, mask=mask, other=0.0)


@triton.jit
def _attend_tile(
    q, k, v, n, n_mask, last_key, m_i, l_i, acc, scale_log2e,
    QUERY_LEN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step of the (BLOCK_G, D) queries over keys n; returns (m_i, l_i, acc)."""
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_G, BLOCK_N)
    visible = n_mask[None, :]
    if QUERY_LEN > 1:
        visible = visible & (n[None, :] <= last_key[:, None])
    qk = tl.where(visible, qk * scale_log2e, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row may see no key yet (an empty split, a verify row before its split): keep exp2 away
    # from -inf - -inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # P @ V in the cache dtype, fp32 accumulate
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc
