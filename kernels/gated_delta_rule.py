"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5) for prefill chunks, chunkwise.

`gated_delta_rule_chunked(q, k (T, Hk, K), v (T, Hv, V), a, b (T, Hv), A_log, dt_bias (Hv,),
cu_seqlens (B+1,), ssm_state (N, Hv, K, V), state_slots (B,), has_initial_state (B,))`
-> o (T, Hv, V) in v's dtype. Per value head h (its key head h // (Hv / Hk)) and token t:
  q, k <- l2norm(q), l2norm(k) (float32, eps 1e-6), q <- q / sqrt(K)
  g = -exp(A_log) softplus(a + dt_bias) (log decay <= 0), beta = sigmoid(b) (in b's dtype)
  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q          (S: K x V, float32)
Each sequence starts from ssm_state[slot] (zeros when has_initial_state is False or the slot is
negative) and its final state is written back there (in the pool's dtype).

Chunkwise form (chunks of BT tokens from the sequence's start, S0 the state before a chunk,
G the within-chunk cumsum of g, D[i, j] = exp(G_i - G_j) for j <= i else 0):
  (I + A) U = diag(beta) V - diag(beta e^G) K S0,   A = strict_lower(diag(beta) K K^T * D)
  O = diag(e^G) Q S0 + (Q K^T * D) U,   S = e^(G_last) S0 + (K * e^(G_last - G))^T U
(I + A)^-1 by forward substitution; one program per (sequence, head, block of V columns) walks
the sequence's chunks (the columns of S are independent). Decode and verify steps use
gated_delta_rule_recurrent.py, the token-by-token form; `gated_delta_rule_ref` is both's torch
reference (chunkwise, with torch's triangular solve).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, dot_precision, next_pow2

L2_EPS = 1e-6  # HF / FLA's l2norm: x * rsqrt(sum(x^2) + eps)


@triton.jit
def gates(a, b, a_log, dt_bias, beta_dtype: tl.constexpr):
    """(g, beta) float32 from the raw a, b projections (any shape), as HF: softplus with
    threshold 20, beta = sigmoid(b) rounded to the model dtype."""
    x = a.to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    return -tl.exp(a_log) * softplus, beta.to(beta_dtype).to(tl.float32)


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, out_ptr, state_ptr,
    cu_ptr, slot_ptr, init_ptr, K, V, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    stride_ot, stride_oh, stride_sn, stride_sh, stride_sk,
    GROUP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, h = tl.program_id(0), tl.program_id(1)
    hk = h // GROUP
    start = tl.load(cu_ptr + seq)
    seq_len = tl.load(cu_ptr + seq + 1) - start
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask, vmask = kk < K, vv < V
    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    S = tl.zeros((BK, BV), dtype=tl.float32)
    if slot >= 0:
        if tl.load(init_ptr + seq).to(tl.int32) != 0:
            S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    r = tl.arange(0, BT)
    i, j = r[:, None], r[None, :]
    for c0 in range(0, seq_len, BT):
        rows = c0 + r
        rmask = rows < seq_len
        tok = (start + rows).to(tl.int64)
        k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        q = (q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]) * scale
        v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + vv[None, :],
                    mask=rmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + tok * stride_at + h, mask=rmask, other=0.0)
        b = tl.load(b_ptr + tok * stride_bt + h, mask=rmask, other=0.0)
        g, beta = gates(a, b, a_log, dt_bias, b_ptr.dtype.element_ty)
        g = tl.where(rmask, g, 0.0)  # padded rows: no decay, no update (k = v = beta = 0)
        beta = tl.where(rmask, beta, 0.0)
        G = tl.cumsum(g, 0)
        decay = tl.where(i >= j, tl.exp(tl.where(i >= j, G[:, None] - G[None, :], 0.0)), 0.0)
        A = tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay * beta[:, None]
        A = tl.where(i > j, A, 0.0)
        # T = (I + A)^-1, row by row: T_r = e_r - sum_{j<r} A_rj T_j (A is strictly lower).
        Tm = tl.where(i == j, 1.0, 0.0)
        for n in range(1, tl.minimum(seq_len - c0, BT)):
            a_n = tl.sum(tl.where(i == n, A, 0.0), 0)  # row n of A, (BT,) over columns
            row = tl.where(r == n, 1.0, 0.0) - tl.sum(a_n[:, None] * Tm, 0)
            Tm = tl.where(i == n, row[None, :], Tm)
        eg = tl.exp(G)
        w = tl.dot(Tm, k * (beta * eg)[:, None], input_precision=PRECISION)  # (BT, BK)
        u = tl.dot(Tm, v * beta[:, None], input_precision=PRECISION)
        u -= tl.dot(w, S, input_precision=PRECISION)  # (BT, BV): the chunk's delta updates
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * eg[:, None], S, input_precision=PRECISION)
        o += tl.dot(qk, u, input_precision=PRECISION)
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])
        g_last = tl.sum(tl.where(r == BT - 1, G, 0.0), 0)  # padded rows keep the last G
        kd = k * tl.exp(g_last - G)[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(kd), u, input_precision=PRECISION)
    if slot >= 0:
        tl.debug_barrier()  # every read of the old state is done
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_mask)


def check_inputs(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_state, state_slots,
                 has_initial_state) -> tuple[int, int, int, int, int]:
    """The launchers' shared checks; returns (B, Hk, Hv, K, V)."""
    check(q.dim() == 3 and q.shape == k.shape, "q and k must be (T, Hk, K)")
    check(v.dim() == 3 and v.shape[0] == q.shape[0], "v must be (T, Hv, V)")
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    check(num_v_heads % num_k_heads == 0, "Hv must be a multiple of Hk")
    check(v.dtype in FLOAT_DTYPES and q.dtype == v.dtype and k.dtype == v.dtype, "q/k/v dtypes")
    check(q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "q/k/v last dim")
    for name, t in (("a", a), ("b", b)):
        check(t.shape == (num_tokens, num_v_heads) and t.stride(1) == 1, f"{name} must be (T, Hv)")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check(t.shape == (num_v_heads,) and t.is_contiguous(), f"{name} must be (Hv,)")
    batch = cu_seqlens.shape[0] - 1
    check(cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous(), "cu_seqlens int32")
    check(ssm_state.dim() == 4 and ssm_state.shape[1:] == (num_v_heads, head_k, head_v),
          "ssm_state must be (N, Hv, K, V)")
    check(ssm_state.stride(3) == 1 and ssm_state.dtype in FLOAT_DTYPES, "ssm_state layout/dtype")
    check(state_slots.shape == (batch,) and state_slots.dtype == torch.int32, "state_slots (B,)")
    check(has_initial_state.shape == (batch,), "has_initial_state must be (B,)")
    tensors = [q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_state, state_slots,
               has_initial_state]
    check(len({t.device for t in tensors}) == 1, "all inputs must be on one device")
    return batch, num_k_heads, num_v_heads, head_k, head_v


def gated_delta_rule_chunked(
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
    out: torch.Tensor | None = None,
    chunk_size: int = 64,
    block_v: int = 64,
) -> torch.Tensor:
    """See the module docstring; q/k/v/a/b may be strided views of a packed projection."""
    batch, num_k_heads, num_v_heads, head_k, head_v = check_inputs(
        q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_state, state_slots, has_initial_state)
    check(chunk_size >= 16 and next_pow2(chunk_size) == chunk_size, "chunk_size: 2^n >= 16")
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    check(out.shape == v.shape and out.dtype == v.dtype and out.stride(2) == 1, "bad out")
    block_k = max(16, next_pow2(head_k))
    block_v = max(16, min(block_v, next_pow2(head_v)))
    if batch and q.shape[0]:
        _chunk_kernel[(batch, num_v_heads, triton.cdiv(head_v, block_v))](
            q, k, v, a, b, A_log, dt_bias, out, ssm_state, cu_seqlens, state_slots,
            has_initial_state, head_k, head_v, head_k**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), out.stride(0), out.stride(1),
            ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
            GROUP=num_v_heads // num_k_heads, BT=chunk_size, BK=block_k, BV=block_v,
            PRECISION=dot_precision(v.dtype), num_warps=4,
        )
    return out


def gates_ref(a, b, A_log, dt_bias) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) float32 (T, Hv), HF's expressions."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Float32 x * rsqrt(sum(x^2) + eps) over the last dim (HF's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule_ref(
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
    out: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Same contract in torch, chunkwise, one sequence at a time, all heads at once."""
    num_v_heads, head_k = v.shape[1], q.shape[2]
    group = num_v_heads // q.shape[1]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    qn = l2norm(q).repeat_interleave(group, 1) * head_k**-0.5  # (T, Hv, K)
    kn = l2norm(k).repeat_interleave(group, 1)
    g, beta = gates_ref(a, b, A_log, dt_bias)  # (T, Hv)
    cu = cu_seqlens.tolist()
    for seq, (start, end) in enumerate(zip(cu, cu[1:], strict=False)):
        slot = int(state_slots[seq])
        state = torch.zeros(num_v_heads, head_k, v.shape[2], device=v.device)
        if slot >= 0 and bool(has_initial_state[seq]):
            state = ssm_state[slot].float()
        for c0 in range(start, end, chunk_size):
            c1 = min(c0 + chunk_size, end)
            qc, kc = qn[c0:c1].transpose(0, 1), kn[c0:c1].transpose(0, 1)  # (Hv, n, K)
            vc = v[c0:c1].float().transpose(0, 1)  # (Hv, n, V)
            gc, bc = g[c0:c1].t(), beta[c0:c1].t()  # (Hv, n)
            G = gc.cumsum(-1)
            mask = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=v.device).tril()
            decay = (G[:, :, None] - G[:, None, :]).masked_fill(~mask, float("-inf")).exp()
            A = (kc @ kc.transpose(1, 2)) * decay * bc[:, :, None]
            eye = torch.eye(c1 - c0, device=v.device)
            lhs = A.tril(-1) + eye  # unit lower triangular I + A
            rhs = torch.cat([kc * (bc * G.exp())[:, :, None], vc * bc[:, :, None]], dim=-1)
            sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
            w, u = sol[..., :head_k], sol[..., head_k:]
            u = u - w @ state  # (Hv, n, V)
            o = (qc * G.exp()[:, :, None]) @ state + ((qc @ kc.transpose(1, 2)) * decay) @ u
            out[c0:c1] = o.transpose(0, 1).to(out.dtype)
            last = G[:, -1:]  # (Hv, 1)
            state = (
                state * last.exp()[:, :, None]
                + (kc * (last - G).exp()[:, :, None]).transpose(1, 2) @ u
            )
        if slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)
    return out
