"""The gated delta rule token by token: decode rows and speculative verify rows (k + 1 tokens).

`gated_delta_rule_recurrent(...)` takes gated_delta_rule_chunked's arguments (same math, see
gated_delta_rule.py) and walks each sequence's tokens in order with the state in registers:
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
One program per (sequence, value head, block of V columns). A verify step passes
`token_state_slots` (T,) int32: the state after each token goes to its own slot (-1: not kept)
and the sequence's slot is only read, so the state after any accepted prefix is at hand; the
slots written must differ from every sequence's read slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2
from .gated_delta_rule import check_inputs, gates, gates_ref, l2norm


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, out_ptr, state_ptr,
    cu_ptr, slot_ptr, init_ptr, tok_slot_ptr, K, V, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, TOKEN_STATES: tl.constexpr,
):
    seq, h = tl.program_id(0), tl.program_id(1)
    hk = h // GROUP
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask, vmask = kk < K, vv < V
    s_offs = h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    S = tl.zeros((BK, BV), dtype=tl.float32)
    if slot >= 0:
        if tl.load(init_ptr + seq).to(tl.int32) != 0:
            S = tl.load(state_ptr + slot * stride_sn + s_offs, mask=s_mask, other=0.0)
            S = S.to(tl.float32)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t64 in range(start, end):
        k = tl.load(k_ptr + t64 * stride_kt + hk * stride_kh + kk, mask=kmask, other=0.0)
        k = k.to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = tl.load(q_ptr + t64 * stride_qt + hk * stride_qh + kk, mask=kmask, other=0.0)
        q = q.to(tl.float32)
        q = (q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)) * scale
        v = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + vv, mask=vmask, other=0.0)
        a = tl.load(a_ptr + t64 * stride_at + h)
        b = tl.load(b_ptr + t64 * stride_bt + h)
        g, beta = gates(a, b, a_log, dt_bias, b_ptr.dtype.element_ty)
        S = S * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(S * k[:, None], 0)) * beta  # (BV,)
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty),
                 mask=vmask)
        if TOKEN_STATES:
            tok_slot = tl.load(tok_slot_ptr + t64).to(tl.int64)
            if tok_slot >= 0:
                tl.store(state_ptr + tok_slot * stride_sn + s_offs,
                         S.to(state_ptr.dtype.element_ty), mask=s_mask)
    if not TOKEN_STATES:
        if slot >= 0:
            tl.debug_barrier()  # every read of the old state is done
            tl.store(state_ptr + slot * stride_sn + s_offs, S.to(state_ptr.dtype.element_ty),
                     mask=s_mask)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    token_state_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_v: int = 32,
) -> torch.Tensor:
    """See the module docstring; q/k/v/a/b may be strided views of a packed projection."""
    batch, num_k_heads, num_v_heads, head_k, head_v = check_inputs(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_state, state_slots, has_initial_state)
    if token_state_slots is not None:
        check(token_state_slots.shape == (q.shape[0],) and token_state_slots.is_contiguous()
              and token_state_slots.dtype == torch.int32, "token_state_slots must be (T,) int32")
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    check(out.shape == v.shape and out.dtype == v.dtype and out.stride(2) == 1, "bad out")
    block_v = min(block_v, next_pow2(head_v))
    if batch and q.shape[0]:
        _recurrent_kernel[(batch, num_v_heads, triton.cdiv(head_v, block_v))](
            q, k, v, a, b, A_log, dt_bias, out, ssm_state, cu_seqlens, state_slots,
            has_initial_state,
            token_state_slots if token_state_slots is not None else state_slots,
            head_k, head_v, head_k**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), out.stride(0), out.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
            GROUP=num_v_heads // num_k_heads, BK=next_pow2(head_k), BV=block_v,
            TOKEN_STATES=token_state_slots is not None, num_warps=4,
        )
    return out


def gated_delta_rule_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    token_state_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract in torch, token by token (HF's recurrent form); sequences of one length
    (decode, verify) step together, others one at a time."""
    num_v_heads, head_k = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    qn = l2norm(q).repeat_interleave(group, 1) * head_k**-0.5  # (T, Hv, K)
    kn = l2norm(k).repeat_interleave(group, 1)
    g, beta = gates_ref(a, b, A_log, dt_bias)  # (T, Hv)
    cu = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(cu, cu[1:], strict=False)]
    slots = state_slots.long()
    use = has_initial_state.bool() & (slots >= 0)
    if len(set(lens)) == 1:
        groups = [(list(range(len(lens))), lens[0] if lens else 0)]
    else:
        groups = [([i], n) for i, n in enumerate(lens)]
    for rows, n in groups:
        idx = torch.tensor(rows, device=v.device)
        state = ssm_state[slots[idx].clamp(min=0)].float()  # unused slots may hold NaN
        state = torch.where(use[idx, None, None, None], state, torch.zeros_like(state))
        tokens = torch.tensor([cu[r] for r in rows], device=v.device)  # (b,) first tokens
        for i in range(n):
            t = tokens + i
            state = state * g[t].exp()[:, :, None, None]  # (b, Hv, K, V)
            kv = (state * kn[t][..., None]).sum(-2)  # (b, Hv, V)
            delta = (v[t].float() - kv) * beta[t][..., None]
            state = state + kn[t][..., None] * delta[..., None, :]
            out[t] = (state * qn[t][..., None]).sum(-2).to(out.dtype)
            if token_state_slots is not None:
                keep = token_state_slots[t].long()
                ssm_state[keep[keep >= 0]] = state[keep >= 0].to(ssm_state.dtype)
        if token_state_slots is None:
            keep = slots[idx] >= 0
            ssm_state[slots[idx][keep]] = state[keep].to(ssm_state.dtype)
    return out
