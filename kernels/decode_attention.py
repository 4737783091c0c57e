"""Paged decode attention: one query token per sequence over its paged KV cache (GQA, split-K).

`decode_attention(q (B, Hq, D), k_cache, v_cache (num_blocks, block_size, Hkv, D), block_tables
(B, max_blocks) int32, context_lens (B,) int32, scale) -> (B, Hq, D)`. Program (b, kv head,
split) reads its slice of the context once for all Hq/Hkv query heads; with several splits a
second pass merges them by log-sum-exp. Splits are cut per sequence in the kernel, so the grid
depends on shapes and the split count only (CUDA-graph safe). Under PDL, when the grid fits
one wave (~2 programs an SM: batch 1's 8 kv heads x 32 splits), a program fetches its first
tile of earlier keys before waiting on the kernel before (which writes q and this step's keys),
so short splits (`graph_shapes.decode_tiling`: 32-key tiles) are nearly free on a batch-1 step's
chain. A larger grid waits first: there the early fetch cost a batch-64 step 2.6%. Batch 64 x
4k tokens reads KV at 93% of the device's copy bandwidth (BENCHMARKS.md, kernels).

Shared prefixes (cascade attention) are attended once per group by shared_prefix_attention.py,
into the first slots of the split partials that the merge here combines.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (
    check,
    check_paged,
    dot_precision,
    is_interpreter,
    next_pow2,
    num_sms,
    pdl,
    pdl_sync,
)
from .attention_tiles import _attend_tile, _kv_slots, _kv_tile
from .shared_prefix_attention import shared_prefix_partials


@triton.jit
def _attend_split(
    m_i, l_i, acc, q_ptr, k_base, v_base, bt_row, start, end, first_new, token, heads, g_mask,
    last_key, d, scale_log2e, stride_qb, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QUERY_LEN: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Keys [start, end) of one row and kv head into (m_i, l_i, acc). Every key but this step's
    QUERY_LEN new ones was stored by an earlier forward: the first tile of those is fetched
    before waiting on the kernel before (PDL, USE_PDL here only for a one-wave grid; it writes
    q and the new keys), so its latency overlaps that kernel."""
    n, n_mask, block_ids, offs = _kv_slots(bt_row, start, end, BLOCK_SIZE, BLOCK_N)
    k, v = _kv_tile(k_base, v_base, block_ids, offs, n_mask & (n < first_new), d,
                    stride_kb, stride_ks, stride_vb, stride_vs)
    pdl_sync(USE_PDL)
    new = n_mask & (n >= first_new)  # all False but in the split holding the new keys
    k_new, v_new = _kv_tile(k_base, v_base, block_ids, offs, new, d,
                            stride_kb, stride_ks, stride_vb, stride_vs)
    k = tl.where(new[:, None], k_new, k)
    v = tl.where(new[:, None], v_new, v)
    q_ptrs = q_ptr + token[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None], other=0.0)  # (BLOCK_G, D)
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i, acc = _attend_tile(q, k, v, n, n_mask, last_key, m_i, l_i, acc, scale_log2e,
                                 QUERY_LEN, PRECISION, UPCAST)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        n, n_mask, block_ids, offs = _kv_slots(bt_row, n0, end, BLOCK_SIZE, BLOCK_N)
        k, v = _kv_tile(k_base, v_base, block_ids, offs, n_mask, d,
                        stride_kb, stride_ks, stride_vb, stride_vs)
        m_i, l_i, acc = _attend_tile(q, k, v, n, n_mask, last_key, m_i, l_i, acc, scale_log2e,
                                     QUERY_LEN, PRECISION, UPCAST)
    return m_i, l_i, acc


# The split count is a runtime argument, never specialized on (Triton would compile a variant
# for 1 and for multiples of 16): the count follows each step's context length
# (graph_shapes.decode_num_splits), and a variant compiled on first use mid-run stalls that step.
# So is the tables' width, which an eager step's longest row sets.
@triton.jit(do_not_specialize=["num_splits", "min_split_len", "stride_bt"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, skip_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2e, num_splits, min_split_len,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
    SHARED_SPLITS: tl.constexpr, BLOCK_P: tl.constexpr, QUERY_LEN: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
    EARLY_FETCH: tl.constexpr,
):
    if not EARLY_FETCH:  # more than one wave: wait first (see the module docstring)
        pdl_sync(USE_PDL)
    early_pdl: tl.constexpr = USE_PDL and EARLY_FETCH  # the wait, if it is still to come
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + b)  # lengths and tables are step inputs: no PDL wait
    skip = 0  # leading tokens the shared-prefix kernel attends (whole KV blocks)
    if SHARED_SPLITS > 0:
        skip = tl.load(skip_ptr + b)
    # Each split gets whole tiles, so only a split's last tile is partial. A floor on its length
    # (a multiple of BLOCK_N) leaves a short row's later splits empty where a long row beside it
    # needs many (graph_shapes.decode_tiling).
    split_len = tl.cdiv(tl.cdiv(context_len - skip, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split_len)
    start = skip + split * split_len
    end = tl.minimum(start + split_len, context_len)
    first_new = context_len - QUERY_LEN

    # Tile row r: query token j = r // GROUP of the row's QUERY_LEN (its last positions), query
    # head g = r % GROUP of this kv head; padded to a dot-friendly size.
    r = tl.arange(0, BLOCK_G)
    token = b * QUERY_LEN + r // GROUP  # row of q / out
    heads = kv_head * GROUP + r % GROUP
    g_mask = r < QUERY_LEN * GROUP
    last_key = first_new + r // GROUP  # causal: the last key each row sees
    d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of log2 scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + b * stride_bt
    # One split (the common decode step) runs straight through: a runtime branch around it cost
    # batch-64 attention 8-13%. Several splits may hold empty ones (a short row's beside a long
    # row, past its context), which skip the reads.
    if ONE_PASS:
        m_i, l_i, acc = _attend_split(
            m_i, l_i, acc, q_ptr, k_base, v_base, bt_row, start, end, first_new, token, heads,
            g_mask, last_key, d, scale_log2e, stride_qb, stride_qh, stride_kb, stride_ks,
            stride_vb, stride_vs, BLOCK_SIZE, BLOCK_N, QUERY_LEN, PRECISION, UPCAST, early_pdl,
        )
    elif start < end:
        m_i, l_i, acc = _attend_split(
            m_i, l_i, acc, q_ptr, k_base, v_base, bt_row, start, end, first_new, token, heads,
            g_mask, last_key, d, scale_log2e, stride_qb, stride_qh, stride_kb, stride_ks,
            stride_vb, stride_vs, BLOCK_SIZE, BLOCK_N, QUERY_LEN, PRECISION, UPCAST, early_pdl,
        )
    else:
        pdl_sync(early_pdl)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # context_len 0 (padding rows) gives zeros, not NaN
    if ONE_PASS:  # one split, no shared prefix: the output itself
        o_ptrs = out_ptr + token[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # part (B * QUERY_LEN, Hq, S + num_splits, D) and lse (B * QUERY_LEN, Hq, S + num_splits),
        # float32, contiguous; the first S = SHARED_SPLITS slots are the shared-prefix kernel's.
        total = SHARED_SPLITS + num_splits
        head_rows = token * tl.num_programs(1) * GROUP + heads
        row = head_rows * total + SHARED_SPLITS + split
        if start < end:  # an empty split writes only its lse (-inf): the merge skips it
            tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
                     mask=g_mask[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # empty split: -inf
        tl.store(lse_ptr + row, lse, mask=g_mask)
        if SHARED_SPLITS > 0:  # a row without a shared prefix: its prefix slots are empty
            p = tl.arange(0, BLOCK_P)
            num_empty = tl.where((skip == 0) & (split == 0), SHARED_SPLITS, 0)
            empty = g_mask[:, None] & (p[None, :] < num_empty)
            none = tl.full([BLOCK_G, BLOCK_P], float("-inf"), tl.float32)
            tl.store(lse_ptr + head_rows[:, None] * total + p[None, :], none, mask=empty)


@triton.jit(do_not_specialize=["num_splits"])
def merge_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_mask = s < num_splits
    row = (b * tl.num_programs(1) + h) * num_splits + s
    lse = tl.load(lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # softmax weight of each split
    # Empty splits and shared-prefix slots are never written: not read either.
    used = s_mask & (w > 0)
    part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=used[:, None], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


MIN_SPLIT_KEYS = 128  # a GPU-filling split count keeps at least this many keys a split


def default_num_splits(batch: int, num_kv_heads: int, max_context_len: int, device) -> int:
    """The smallest power-of-two split count whose programs fill the last wave of ~2 resident
    programs per SM to >= 90% (132 SMs: batch 64 x 8 kv heads -> 1, batch 1 -> 32), keeping at
    least MIN_SPLIT_KEYS tokens per split; the best-filled count when none reaches 90%."""
    slots = 2 * num_sms(device)
    best, best_fill = 1, 0.0
    splits = 1
    while splits <= 64 and (splits == 1 or max_context_len // splits >= MIN_SPLIT_KEYS):
        programs = batch * num_kv_heads * splits
        fill = programs / (triton.cdiv(programs, slots) * slots)
        if fill >= 0.9:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
        splits *= 2
    return best


MAX_TILE_ROWS = 64  # query rows (tokens x query heads) of one kv head's decode tile


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    shared_chunks: torch.Tensor | None = None,
    shared_lens: torch.Tensor | None = None,
    shared_splits: int = 4,
    block_n: int | None = None,
    min_split_len: int = 0,
    num_warps: int | None = None,
    num_stages: int | None = None,
    query_len: int = 1,
) -> torch.Tensor:
    """q (B, Hq, D) -> out (B, Hq, D) in q's dtype (fp32 / bf16 / fp16; head_dim and block_size
    powers of two). `max_context_len` (host int, optional) only picks the split count, never the
    result; without it the block-table width stands in (use that under a CUDA graph).
    `min_split_len` (a multiple of the key tile) floors each row's split length: with many
    splits, short rows then use their first few and only a long row all of them.

    `query_len` > 1 (a speculative verify step: the last token and its drafts): q is
    (B * query_len, Hq, D), sequence b's rows b * query_len.. are its last query_len positions,
    each attending causally; the query_len x Hq / Hkv rows of a kv head share one tile, so
    query_len * Hq / Hkv <= MAX_TILE_ROWS. No shared prefixes then.

    `shared_chunks` (C, 1 + R) and `shared_lens` (B,) (see shared_prefix_attention.py; R from
    its `shared_prefix_rows`) attend shared prefixes once per chunk, in `shared_splits` splits. A
    row's shared length must be a multiple of the block size, less than its context length, and
    its first blocks must equal its leader's."""
    check(q.dim() == 3 and k_cache.dim() == 4, "q must be (B, Hq, D), caches (N, bs, Hkv, D)")
    q_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    check(query_len >= 1 and q_rows % query_len == 0, "q must have query_len rows a sequence")
    batch = q_rows // query_len
    check(query_len == 1 or query_len * num_heads // num_kv_heads <= MAX_TILE_ROWS,
          f"query_len x Hq / Hkv must be <= {MAX_TILE_ROWS}")
    check(query_len == 1 or shared_chunks is None, "shared prefixes need query_len 1")
    check_paged(q, k_cache, v_cache, block_tables, batch)
    check(context_lens.dtype == torch.int32 and context_lens.shape == (batch,),
          "context_lens must be (B,) int32")
    check(context_lens.is_contiguous(), "context_lens must be contiguous")
    check(len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) == 1,
          "all inputs must be on one device")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    interp = is_interpreter()
    max_len = max_context_len or block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_len, q.device)
    block_n = block_n or (16 if interp else 64)
    check(min_split_len >= 0 and min_split_len % block_n == 0,
          "min_split_len must be a multiple of the key tile:", block_n)
    shared = shared_chunks is not None
    prefix_splits = shared_splits if shared else 0
    total = prefix_splits + num_splits
    if total > 1:
        part = torch.empty(q_rows, num_heads, total, head_dim, device=q.device,
                           dtype=torch.float32)
        lse = torch.empty(q_rows, num_heads, total, device=q.device, dtype=torch.float32)
    else:
        part = lse = out  # unused by the kernel
    if shared:
        shared_prefix_partials(
            q, k_cache, v_cache, block_tables, shared_chunks, shared_lens, scale, part, lse,
            num_splits=prefix_splits, block_n=block_n,
        )
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, shared_lens if shared else context_lens,
        out, part, lse,
        scale * math.log2(math.e), num_splits, min_split_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, next_pow2(query_len * group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, ONE_PASS=total == 1,
        SHARED_SPLITS=prefix_splits, BLOCK_P=next_pow2(max(prefix_splits, 1)),
        QUERY_LEN=query_len, PRECISION=dot_precision(q.dtype), UPCAST=interp,
        EARLY_FETCH=batch * num_kv_heads * num_splits <= 2 * num_sms(q.device),
        num_warps=num_warps or 4, **pdl(q.device),
        num_stages=num_stages or (2 if q.dtype == torch.float32 else 3),  # fp32 tiles: 2x smem
    )
    if total > 1:
        merge_kernel[(q_rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), total,
            BLOCK_S=max(16, next_pow2(total)), HEAD_DIM=head_dim,  # one variant up to 16
            num_warps=4 if head_dim >= 128 else 2, **pdl(q.device),
        )
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float32 oracle, one sequence at a time (syncs on context_lens; tests only)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()  # (n, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        qb = q[b].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # (Hkv, G, D)
        probs = (torch.einsum("hgd,nhd->hgn", qb, k) * scale).softmax(-1)
        out[b] = torch.einsum("hgn,nhd->hgd", probs, v).reshape(num_heads, head_dim)
    return out
