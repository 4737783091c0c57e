"""Paged prefill / extend attention: variable-length causal queries over cached prefix + new tokens.

`prefill_attention(q (T, Hq, D), k_cache, v_cache, block_tables, cu_seqlens_q (B+1,) int32,
context_lens (B,) int32, max_query_len, scale) -> (T, Hq, D)`. Sequence b's queries are the last
q_len = cu[b+1] - cu[b] of its context_len positions (their KV is already in the cache); query
i sees keys j <= context_len - q_len + i. Decode rows (q_len 1) and prefill rows mix freely.
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
    shared_memory,
)
from .decode_attention import merge_kernel


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, n0, k_base, v_base, bt_row, pos, kv_end, d, scale_log2e,
    stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """One online-softmax step over keys [n0, n0 + BLOCK_N); MASKED applies causality/length."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    if BLOCK_SIZE >= BLOCK_N:  # tiles are aligned, so the whole tile sits in one KV block
        block_ids = tl.load(bt_row + n0 // BLOCK_SIZE).to(tl.int64)
    else:
        block_ids = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        block_ids = block_ids[:, None]
    offs = (n % BLOCK_SIZE)[:, None]
    k_ptrs = k_base + block_ids * stride_kb + offs * stride_ks + d[None, :]
    v_ptrs = v_base + block_ids * stride_vb + offs * stride_vs + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if UPCAST:
        k = k.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
    if MASKED:
        qk = tl.where((n[None, :] <= pos[:, None]) & n_mask[None, :], qk, float("-inf"))
    # The scale folds into one FMA per score: exp2(qk * scale * log2(e) - m). Unmasked tiles
    # hold keys every row sees, so m is finite there; in a masked tile of a key split a row may
    # see no key yet: keep exp2 away from -inf - -inf.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2e)
    m_use = m_new
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk * scale_log2e - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # P @ V in the cache dtype, fp32 accumulate
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


# The split count and the table stride (the step's widest table) are runtime arguments: one
# compiled variant for every value, so none compiles mid-run.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_ptr, lens_ptr, part_ptr, lse_ptr,
    scale_log2e, num_splits,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    # Query tiles are the slowest grid axis, reversed: the longest (causal) tiles start first.
    q_tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid covers the longest query; shorter ones stop here
        return
    context_len = tl.load(lens_ptr + b)
    prefix_len = context_len - q_len  # cached tokens before this step's queries

    # Row r of the tile is query token q_tile * BLOCK_Q + r // G_PAD, head r % G_PAD of the
    # group: all query heads of one kv head share each K/V tile.
    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q_tile * BLOCK_Q + r // G_PAD
    g = r % G_PAD
    row_mask = (qi < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # (BLOCK_M, D)
    if UPCAST:
        q = q.to(tl.float32)
    pos = prefix_len + qi  # absolute position of each row's query token

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, HEAD_DIM], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + b * stride_bt
    first_pos = prefix_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(context_len, first_pos + BLOCK_Q)  # past the last key any row sees
    # Keys [0, full_end) are visible to every row: no masks there. The rest is masked. Never
    # below key 0: inputs with context_len < q_len (a CUDA graph's warm-up on zeroed buffers)
    # must read nothing rather than table entries before the row.
    full_end = tl.maximum((first_pos + 1) // BLOCK_N * BLOCK_N, 0)
    # Key split `split` of num_splits: whole tiles, so tiles stay aligned to full_end.
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    for n0 in range(lo, tl.minimum(full_end, hi), BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, k_base, v_base, bt_row, pos, kv_end, d, scale_log2e,
            stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_SIZE, BLOCK_N, False, PRECISION, UPCAST,
        )
    for n0 in range(tl.maximum(full_end, lo), hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, n0, k_base, v_base, bt_row, pos, kv_end, d, scale_log2e,
            stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_SIZE, BLOCK_N, True, PRECISION, UPCAST,
        )
    if ONE_PASS:  # key 0 is in every row's only split: l_i > 0
        out = acc / l_i[:, None]
        o_ptrs = (out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh
                  + d[None, :])
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # part (T, Hq, num_splits, D) and lse (T, Hq, num_splits), float32, as the decode
        # kernel's merge pass reads them; a split a row sees no key of stores lse -inf.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        row = ((q_start + qi) * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
                 mask=row_mask[:, None])
        tl.store(lse_ptr + row, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")),
                 mask=row_mask)


MIN_SPLIT_KEYS = 1024  # keys a split gets at least, so its programs outweigh the merge pass
TALL_MIN_ROWS = 896  # query rows (tokens x padded group) from which one chunk takes tall tiles


def prefill_tile(batch: int, query_rows: int, dtype: torch.dtype, smem: int,
                 head_dim: int = 128) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of a launch on the GPU. 64 x 64 tiles and 4 warps: the
    best of 6 configs for batches of several rows (bf16, Llama-3.1-8B heads). One long chunk
    (the prefill lane's 4,096 tokens) takes 128 x 128 tiles and 8 warps where 3 stages of K and
    V and the query tile fit: each K/V tile then serves twice the query rows (7-13% faster a
    call at 32k keys, never slower; a lane prompt's TTFT 10% shorter). Not 128 x 64 tiles for
    groups of 4 query heads: faster a call at their best split counts, but slower end to end
    where a launch has one split and few tiles (docs/benchmark-log.md). Heads wider than 128
    (Qwen3.5's 256) take 64 x 64 tiles in 2 stages: 3 stages of them, or the tall tile, need
    more shared memory than an H100 has."""
    size = dtype.itemsize
    if head_dim > 128:
        return 64, 64, 4, 2
    if batch == 1 and query_rows >= TALL_MIN_ROWS and (3 * 2 + 1) * 128 * 128 * size <= smem:
        return 128, 128, 8, 3
    return 64, 64, 4, 2 if size == 4 else 3


def prefill_tiles(dtype: torch.dtype, device: torch.device, head_dim: int = 128
                  ) -> set[tuple[int, int, int, int]]:
    """Every tile `prefill_tile` gives on this GPU (the engine compiles each at start-up)."""
    smem = shared_memory(device)
    return {prefill_tile(b, TALL_MIN_ROWS, dtype, smem, head_dim) for b in (1, 2)}


def prefill_num_splits(query_lens: list[int], context_lens: list[int], num_heads: int,
                       num_kv_heads: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> int:
    """Key splits for a step (host lists, no sync): each program attends one query tile over
    its keys, so a chunk of a long prompt beside short rows is a handful of programs that each
    read tens of thousands of keys while most SMs sit idle. Cut the longest program's keys until
    the step's programs fill the SMs once (two an SM for 4-warp tiles, one for 8), never more.
    A sweep's best counts sat exactly there; a count past it adds a second, mostly empty wave
    (1.5x slower). At most 16 ways, never below MIN_SPLIT_KEYS keys a split."""
    if device.type != "cuda" or not context_lens:
        return 1
    g_pad = next_pow2(num_heads // num_kv_heads)
    block_m, _, warps, _ = prefill_tile(len(query_lens), max(query_lens) * g_pad, dtype,
                                        shared_memory(device), head_dim)
    block_q = block_m // g_pad
    work = sum(-(-n // block_q) * c for n, c in zip(query_lens, context_lens)) * num_kv_heads
    longest = max(context_lens)
    slots = num_sms(device) * (2 if warps == 4 else 1)
    return max(1, min(longest * slots // max(work, 1), 16, longest // MIN_SPLIT_KEYS))


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int = 1,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) -> out (T, Hq, D). `max_query_len` is the host-side max of the query lengths
    (sizes the grid without a sync); rows of q past cu_seqlens_q[-1] are left untouched with one
    split, zeroed with more. `num_splits` > 1 cuts each query tile's keys into that many ranges
    attended by separate programs and merged by log-sum-exp (`prefill_num_splits`)."""
    check(q.dim() == 3 and k_cache.dim() == 4, "q must be (T, Hq, D), caches (N, bs, Hkv, D)")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    batch = context_lens.shape[0]
    check_paged(q, k_cache, v_cache, block_tables, batch)
    check(context_lens.dtype == torch.int32 and context_lens.is_contiguous(),
          "context_lens must be (B,) int32")
    check(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,),
          "cu_seqlens_q must be (B+1,) int32")
    check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    check(len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)})
          == 1, "all inputs must be on one device")
    if out is None:
        out = torch.empty_like(q)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "bad out")
    check(num_splits >= 1, "num_splits must be >= 1")
    if batch == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = next_pow2(group)
    interp = is_interpreter()
    tile = (16, 16, 4, 2) if interp else prefill_tile(batch, max_query_len * g_pad, q.dtype,
                                                      shared_memory(q.device), head_dim)
    block_m = max(block_m or tile[0], 16, g_pad)
    block_q = block_m // g_pad
    block_n = block_n or tile[1]
    if num_splits > 1:
        part = torch.empty(num_tokens, num_heads, num_splits, head_dim, device=q.device,
                           dtype=torch.float32)
        # Rows past cu_seqlens_q[-1] are never written: -inf makes the merge give them zeros.
        lse = torch.full((num_tokens, num_heads, num_splits), float("-inf"), device=q.device)
    else:
        part = lse = out  # unused by the kernel
    grid = (batch * num_splits, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens, part, lse,
        scale * math.log2(math.e), num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        ONE_PASS=num_splits == 1, PRECISION=dot_precision(q.dtype), UPCAST=interp,
        num_warps=num_warps or tile[2],
        num_stages=num_stages or tile[3],
    )
    if num_splits > 1:
        merge_kernel[(num_tokens, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_splits,
            BLOCK_S=max(16, next_pow2(num_splits)), HEAD_DIM=head_dim,
            num_warps=4 if head_dim >= 128 else 2, USE_PDL=False,
        )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float32 oracle, one sequence at a time with an explicit bottom-right causal mask."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    for b, n in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float()  # (n, Hkv, D)
        v = v_cache[blocks].flatten(0, 1)[:n].float()
        qb = q[start:end].float().view(end - start, num_kv_heads, -1, head_dim)  # (Tq, Hkv, G, D)
        scores = torch.einsum("thgd,nhd->hgtn", qb, k) * scale
        pos = torch.arange(end - start)[:, None] + (n - (end - start))
        visible = torch.arange(n)[None, :] <= pos  # (Tq, n)
        probs = scores.masked_fill(~visible.to(q.device), float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hgtn,nhd->thgd", probs, v).reshape(-1, num_heads, head_dim)
    return out
