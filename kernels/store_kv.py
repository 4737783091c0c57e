"""KV-cache store by slot mapping: k, v (T, Hkv, D) -> k_cache, v_cache at flat slots.

`store_kv(k, v, k_cache, v_cache, slot_mapping)` writes token t's heads to block
slot // block_size, offset slot % block_size of both caches in one launch. A negative slot
(a padded token of a CUDA-graph batch) is skipped. k / v may be strided views of a packed qkv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, block_size, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        mask = h < num_kv_heads
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        kc = kc_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d
        vc = vc_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d
        tl.store(kc, k, mask=mask)
        tl.store(vc, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v (T, Hkv, D); caches (num_blocks, block_size, Hkv, D); slot_mapping (T,) int64."""
    check(k.dim() == 3 and k.shape == v.shape, "k and v must be (T, Hkv, D) of one shape")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches (N, bs, Hkv, D)")
    num_tokens, num_kv_heads, head_dim = k.shape
    check(k_cache.shape[2:] == (num_kv_heads, head_dim), "cache heads / head_dim differ from k")
    check(k.dtype in FLOAT_DTYPES, f"unsupported dtype {k.dtype}")
    check(len({k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) == 1, "dtypes differ")
    check(head_dim & (head_dim - 1) == 0, "head_dim must be a power of two")
    check(slot_mapping.shape == (num_tokens,), "slot_mapping must be (T,)")
    check(slot_mapping.dtype in (torch.int64, torch.int32), "slot_mapping must be int64/int32")
    check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    check(all(x.stride(-1) == 1 for x in (k, v, k_cache, v_cache)), "last dims must be dense")
    check(len({x.device for x in (k, v, k_cache, v_cache, slot_mapping)}) == 1, "one device")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1], num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_H=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )  # fmt: skip


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The layers' index_copy_, skipping negative slots (syncs; tests only)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]
