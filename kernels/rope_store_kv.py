"""Everything between the qkv matmul and attention, one launch: per-head q/k RMSNorm (Qwen3),
rotary embedding of q and k, and the store of k and v into the paged KV cache.

`rope_store_kv(qkv (T, (Hq + 2 Hkv) D), positions (T,), cos_sin_cache (P, D), k_cache, v_cache
(num_blocks, block_size, Hkv, D), slot_mapping (T,), num_heads, q_norm=None, k_norm=None, eps)`
-> q (T, Hq, D), a view of qkv rotated in place. The math is the unfused path's
(layers/norm.py, then layers/rotary.py in float32 from the float32 table); a negative slot
(a padded token of a CUDA-graph batch) stores nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2, pdl, pdl_sync


@triton.jit
def _norm_rotate(x_ptr, num_heads, cos, sin, w1, w2, eps,
                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads [0, num_heads) at x_ptr (contiguous, HEAD_DIM apart) -> rotated halves, float32;
    w1, w2: the norm weight's halves (float32)."""
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, half)[None, :]
    mask = h < num_heads
    x1 = tl.load(x_ptr + h * HEAD_DIM + i, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + h * HEAD_DIM + half + i, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if QK_NORM:  # weight * (x * rstd).to(dtype), rounded as HF's RMSNorm
        sum_sq = tl.sum(x1 * x1, 1, keep_dims=True) + tl.sum(x2 * x2, 1, keep_dims=True)
        rstd = tl.math.rsqrt(sum_sq / HEAD_DIM + eps)
        # A product of two 16-bit floats is exact in float32, so this rounds like a bf16 multiply.
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr, pos_ptr, table_ptr, kc_ptr, vc_ptr, slot_ptr, qn_ptr, kn_ptr, eps,
    num_heads, num_kv_heads, block_size, stride_t, stride_table,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    QK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    # Positions, slots, the table and the norm weights are step inputs or weights: fetched
    # before waiting on the kernel before (PDL; the qkv matmul), so their two dependent loads
    # (position, then its table row) overlap that kernel's tail.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, half)[None, :]
    cos = tl.load(table_ptr + pos * stride_table + i)  # (1, half) float32
    sin = tl.load(table_ptr + pos * stride_table + half + i)
    qw1, qw2, kw1, kw2 = cos, cos, cos, cos  # placeholders without q/k norms
    if QK_NORM:
        qw1 = tl.load(qn_ptr + i).to(tl.float32)
        qw2 = tl.load(qn_ptr + half + i).to(tl.float32)
        kw1 = tl.load(kn_ptr + i).to(tl.float32)
        kw2 = tl.load(kn_ptr + half + i).to(tl.float32)
    pdl_sync(USE_PDL)
    q_ptr = qkv_ptr + t * stride_t
    k_ptr = q_ptr + num_heads * HEAD_DIM
    v_ptr = k_ptr + num_kv_heads * HEAD_DIM

    q1, q2 = _norm_rotate(q_ptr, num_heads, cos, sin, qw1, qw2, eps, HEAD_DIM, BLOCK_HQ, QK_NORM)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_mask = hq < num_heads
    tl.store(q_ptr + hq * HEAD_DIM + i, q1.to(qkv_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_ptr + hq * HEAD_DIM + half + i, q2.to(qkv_ptr.dtype.element_ty), mask=q_mask)

    if slot >= 0:
        k1, k2 = _norm_rotate(k_ptr, num_kv_heads, cos, sin, kw1, kw2, eps, HEAD_DIM, BLOCK_HK,
                              QK_NORM)
        hk = tl.arange(0, BLOCK_HK)[:, None]
        kv_mask = hk < num_kv_heads
        block, offset = slot // block_size, slot % block_size
        kc = kc_ptr + block * stride_kcb + offset * stride_kcs + hk * stride_kch
        tl.store(kc + i, k1.to(kc_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(kc + half + i, k2.to(kc_ptr.dtype.element_ty), mask=kv_mask)
        d = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(v_ptr + hk * HEAD_DIM + d, mask=kv_mask)
        vc = vc_ptr + block * stride_vcb + offset * stride_vcs + hk * stride_vch
        tl.store(vc + d, v, mask=kv_mask)


def rope_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """See the module docstring; returns q (T, Hq, D), a view of qkv."""
    check(qkv.dim() == 2 and qkv.stride(1) == 1, "qkv must be (T, (Hq + 2 Hkv) D), last dim 1")
    check(qkv.dtype in FLOAT_DTYPES, f"unsupported dtype {qkv.dtype}")
    num_tokens = qkv.shape[0]
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches (N, bs, Hkv, D)")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check(k_cache.dtype == qkv.dtype and v_cache.dtype == qkv.dtype, "qkv and caches dtypes")
    check(k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "caches need a contiguous last dim")
    check(head_dim >= 2 and next_pow2(head_dim) == head_dim, "head_dim must be a power of two")
    check(qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim,
          f"qkv has {qkv.shape[1]} columns, expected (Hq + 2 Hkv) * D")
    check(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim,
          "cos_sin_cache must be (P, D)")
    check(cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1,
          "cos_sin_cache must be float32 with a contiguous last dim")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check(t.shape == (num_tokens,) and t.is_contiguous(), f"{name} must be (T,)")
        check(t.dtype in (torch.int64, torch.int32), f"{name} must be int64/int32")
    check((q_norm is None) == (k_norm is None), "q_norm and k_norm come together")
    tensors = [qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping]
    if q_norm is not None:
        for w in (q_norm, k_norm):
            check(w.shape == (head_dim,) and w.is_contiguous(), "q/k norm weights must be (D,)")
        tensors += [q_norm, k_norm]
    check(len({t.device for t in tensors}) == 1, "all inputs must be on one device")
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if num_tokens:
        _rope_store_kv_kernel[(num_tokens,)](
            qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
            q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, eps,
            num_heads, num_kv_heads, block_size, qkv.stride(0), cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HEAD_DIM=head_dim, BLOCK_HQ=next_pow2(num_heads), BLOCK_HK=next_pow2(num_kv_heads),
            QK_NORM=q_norm is not None, num_warps=4 if num_heads * head_dim >= 2048 else 2,
            **pdl(qkv.device),
        )
    return q


def rope_store_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The unfused torch ops (layers/*); returns q (T, Hq, D) and writes the caches."""
    from .rms_norm import rms_norm_ref
    from .rotary import rotary_embedding_ref

    num_kv_heads, head_dim = k_cache.shape[2:]
    heads = qkv.view(qkv.shape[0], -1, head_dim)  # (T, Hq + 2 Hkv, D)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[keep])
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[keep])
    return q
