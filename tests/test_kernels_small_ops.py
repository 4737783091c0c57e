"""The small kernels (RMSNorm, the MTP input, rotary, fused rope + KV store, SiLU-mul)
against their references, and the launchers' input checks."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    BF16,
    DEVICE,
    DTYPES,
    F32,
    INTERP,
    assert_elem,
    assert_rel,
    gpu,
    needs_triton,
    paged_cache,
    poisoned,
    randn,
)

from tinyserve.kernels.decode_attention import decode_attention
from tinyserve.kernels.gemv import gemv
from tinyserve.kernels.mtp_input import mtp_input, mtp_input_ref
from tinyserve.kernels.rms_norm import rms_norm, rms_norm_ref
from tinyserve.kernels.rope_store_kv import rope_store_kv, rope_store_kv_ref
from tinyserve.kernels.rotary import rotary_embedding, rotary_embedding_ref
from tinyserve.kernels.sampling import sample_race, sample_race_ref
from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows
from tinyserve.kernels.silu_mul import silu_mul, silu_mul_ref
from tinyserve.model.layers.zero_centred_norm import zero_centred_rms_norm_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    x, weight = randn(7, 300, dtype=dtype, scale=3.0), randn(300, dtype=dtype)
    residual = randn(7, 300, dtype=dtype) if with_residual else None
    out = poisoned(x)
    res = rms_norm(x, weight, 1e-6, residual, out=out)
    ref = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert_elem(res[1], ref[1], dtype)
        if not INTERP or dtype != BF16:  # the interpreter truncates bf16 casts
            assert torch.equal(res[1], ref[1])  # the residual stream is bit exact
        res, ref = res[0], ref[0]
    assert res is out
    assert_elem(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_round_last_is_the_zero_centred_norm(dtype, with_residual):
    """Qwen3.5's norms: a float32 (1 + w) multiplies before the one rounding, output in x's dtype;
    also per head on a strided (T, H, D) view (the gated attention's q/k norms)."""
    x, weight = randn(7, 300, dtype=dtype, scale=3.0), 1.0 + randn(300, dtype=F32, scale=0.1)
    residual = randn(7, 300, dtype=dtype) if with_residual else None
    res = rms_norm(x, weight, 1e-6, residual, round_last=True)
    ref = zero_centred_rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        assert_elem(res[1], ref[1], dtype)
        res, ref = res[0], ref[0]
    assert res.dtype == dtype
    assert_elem(res, ref, dtype)
    qkv = randn(5, 6 * 64, dtype=dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    w64 = 1.0 + randn(64, dtype=F32, scale=0.1)
    out = rms_norm(q, w64, 1e-6, round_last=True)
    assert_elem(out, zero_centred_rms_norm_ref(q, w64, 1e-6), dtype)


def test_rms_norm_per_head_strided_in_place():
    """Qwen3 q-norm: (T, H, D) view of a packed qkv; residual updated in place."""
    qkv = randn(5, 6 * 64, dtype=BF16)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    weight = randn(64, dtype=BF16)
    assert_elem(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6), BF16)
    x, residual = randn(3, 128, dtype=BF16), randn(3, 128, dtype=BF16)
    ones = torch.ones(128, dtype=BF16, device=DEVICE)
    expected = rms_norm_ref(x, ones, 1e-5, residual)
    out, res = rms_norm(x, ones, 1e-5, residual, out=x, residual_out=residual)
    assert out is x and res is residual
    assert_elem(x, expected[0], BF16)
    assert_elem(residual, expected[1], BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_first", [True, False])
def test_mtp_input(dtype, hidden_first):
    """cat[norm(hidden), norm(embed[ids])] with position-0 rows' embedding zeroed (its half
    all zero), the halves in either order, hidden a strided view, into a poisoned out."""
    n = 300  # not a power of two: masked columns
    hidden = randn(6, n + 20, dtype=dtype, scale=3.0)[:, :n]
    ids = torch.tensor([3, 0, 9, 3, 1, 7], device=DEVICE)
    positions = torch.tensor([5, 0, 17, 1, 0, 2], device=DEVICE)
    embed, hw, tw = randn(10, n, dtype=dtype), randn(n, dtype=dtype), randn(n, dtype=dtype)
    out = torch.full((6, 2 * n), float("nan"), dtype=dtype, device=DEVICE)
    res = mtp_input(hidden, ids, positions, embed, hw, tw, 1e-6, hidden_first, out=out)
    assert res is out
    assert_elem(
        out, mtp_input_ref(hidden, ids, positions, embed, hw, tw, 1e-6, hidden_first), dtype
    )
    token_half = out[:, n:] if hidden_first else out[:, :n]
    assert (token_half[positions == 0] == 0).all() and (token_half[positions != 0] != 0).any()


def test_mtp_input_rejects_bad_inputs():
    h, w = randn(2, 8, dtype=BF16), randn(8, dtype=BF16)
    ids = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        mtp_input(h, ids, ids, randn(4, 8), w, w, 1e-6)
    with pytest.raises(ValueError, match="ids, positions"):
        mtp_input(h, ids[:1], ids, randn(4, 8, dtype=BF16), w, w, 1e-6)


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_rms_norm_rows_per_program(rows):
    x, r, w = randn(13, 64, dtype=BF16), randn(13, 64, dtype=BF16), randn(64, dtype=BF16)
    out, res = rms_norm(x, w, 1e-6, r, block_m=rows, num_warps=2)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, r)
    assert_elem(out, ref, BF16)
    assert_elem(res, ref_res, BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [True, False])
def test_rotary(dtype, inplace):
    qkv = randn(9, (8 + 2 * 2) * 64, dtype=dtype)
    q = qkv[:, : 8 * 64].view(9, 8, 64)
    k = qkv[:, 8 * 64 : 10 * 64].view(9, 2, 64)
    angles = torch.arange(40, device=DEVICE)[:, None] * torch.rand(32, device=DEVICE)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # (P, D) float32
    positions = torch.randint(0, 40, (9,), device=DEVICE)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, cache)
    q_before = q.clone()
    v_before = qkv[:, 10 * 64 :].clone()
    q_out, k_out = rotary_embedding(positions, q, k, cache, inplace=inplace)
    assert (q_out is q) == inplace and (k_out is k) == inplace
    assert_elem(q_out, q_ref, dtype)
    assert_elem(k_out, k_ref, dtype)
    assert torch.equal(qkv[:, 10 * 64 :], v_before)  # v untouched
    q_only, none = rotary_embedding(positions, q_before, None, cache)  # no k
    assert none is None
    assert_elem(q_only, q_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (6, 2, 128)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv(dtype, num_heads, num_kv_heads, head_dim, qk_norm):
    """Fused q/k norm + rotary + KV store == the unfused ops; padded tokens (slot -1) store
    nothing, every other cache slot keeps its value."""
    tokens, block_size = 7, 16
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    positions = torch.tensor([0, 5, 17, 100, 3, 64, 9], device=DEVICE)
    cache = randn(128, head_dim)  # any float32 table: the kernel only looks it up
    slots = torch.tensor([3, 40, -1, 17, 63, 0, -1], device=DEVICE)
    norms = (randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)) if qk_norm else (None,) * 2
    caches = [randn(4, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q_ref = rope_store_kv_ref(
        qkv.clone(), positions, cache, *ref_caches, slots, num_heads, *norms, eps=1e-6
    )
    q = rope_store_kv(qkv, positions, cache, *caches, slots.int(), num_heads, *norms, eps=1e-6)
    assert q.data_ptr() == qkv.data_ptr()  # rotated in place
    # Relative to the norm: the interpreter truncates each of the 16-bit roundings.
    assert_rel(q, q_ref, dtype)
    assert_rel(caches[0], ref_caches[0], dtype)
    assert torch.equal(caches[1], ref_caches[1])  # v is copied, never rounded


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = randn(5, 2 * 1100, dtype=dtype, scale=3.0)  # I = 1100: two column blocks, one partial
    out = poisoned(x[:, :1100].contiguous())
    assert silu_mul(x, out) is out
    assert_elem(out, silu_mul_ref(x), dtype)


def test_launchers_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.float64"):  # value appended
        rms_norm(randn(2, 8).double(), randn(8).double(), 1e-6)
    q = randn(2, 4, 64)
    k_cache, v_cache, table, lens = paged_cache(2, [3, 5], 2, 64, 16, F32)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q, k_cache, v_cache, table.long(), lens, 0.1)
    with pytest.raises(ValueError, match="dtypes"):
        decode_attention(q.to(BF16), k_cache, v_cache, table, lens, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(randn(2, 3, 64), k_cache, v_cache, table, lens, 0.1)
    skip = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    chunks = torch.full((1, 1 + shared_prefix_rows(4, 2)), -1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="shared_chunks must be"):
        decode_attention(
            q, k_cache, v_cache, table, lens, 0.1, shared_chunks=chunks[:, 1:], shared_lens=skip
        )
    with pytest.raises(ValueError, match="shared_lens"):
        decode_attention(q, k_cache, v_cache, table, lens, 0.1, shared_chunks=chunks)
    with pytest.raises(ValueError, match="Hq / Hkv <= 64"):  # 128 query heads on one kv head
        mqa_cache = k_cache[:, :, :1].contiguous()
        decode_attention(
            randn(2, 128, 64),
            mqa_cache,
            mqa_cache,
            table,
            lens,
            0.1,
            shared_chunks=chunks,
            shared_lens=skip,
        )
    with pytest.raises(ValueError, match="1..64 rows"):
        gemv(randn(65, 64), randn(64, 64))  # K <= 2N: no split-K, and too many rows for dot
    with pytest.raises(ValueError, match="1..128 rows"):
        gemv(randn(129, 64), randn(8, 64), method="split")
    with pytest.raises(ValueError, match="stream is for"):
        gemv(randn(17, 64), randn(8, 64), method="stream")
    with pytest.raises(ValueError, match="method"):
        gemv(randn(2, 64), randn(8, 64), method="splitk")
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(randn(8, 4).t())
    with pytest.raises(ValueError, match="float32"):
        sample_race(randn(2, 8, dtype=BF16), torch.zeros(2, dtype=torch.int64, device=DEVICE))


@gpu
@pytest.mark.gpu
def test_small_ops_gpu_real_shapes():
    x, r, w = randn(64, 4096, dtype=BF16), randn(64, 4096, dtype=BF16), randn(4096, dtype=BF16)
    out, res = rms_norm(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    assert torch.equal(res, ref_res)
    assert_elem(out, ref, BF16)
    g = randn(64, 2 * 14336, dtype=BF16, scale=3.0)
    assert_elem(silu_mul(g), silu_mul_ref(g), BF16)
    keys = torch.randint(-(2**62), 2**62, (64,), device=DEVICE)
    logits = randn(64, 151936, scale=3.0)
    assert torch.equal(sample_race(logits, keys), sample_race_ref(logits, keys))
