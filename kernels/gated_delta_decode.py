"""A Gated DeltaNet decode step in one launch: causal conv1d + SiLU, l2norm, gates, the gated
delta rule's recurrent update and the gated RMSNorm, for rows of exactly one token each.

`gated_delta_decode(x (T, C), z (T, Hv, V), a, b (T, Hv), conv_weight (C, W), A_log, dt_bias
(Hv,), norm_weight (V,), eps, conv_state (N, W-1, C), ssm_state (N, Hv, K, V), state_slots (T,),
has_initial_state (T,))` -> (T, Hv, V) in x's dtype, with C = 2 Hk K + Hv V split [q | k | v]:
the chain causal_conv1d -> gated_delta_rule_recurrent -> gated_rms_norm of one decode step, in
their rounding order (conv rounded to x's dtype before the SiLU, q/k/v and o rounded to x's
dtype as the chain stores them, the norm's weight product rounded as gated_rms_norm does).
Row t reads and advances the window and state of slot state_slots[t] (from zeros when
has_initial_state[t] is False; a negative slot reads zeros and writes nothing).

One program per (row, value head) holds the head's whole (K, V) float32 state in registers (the
norm needs all of a head's V) and recomputes its key head's q/k conv (W taps, cheap). Its v
channels' window is its own to rewrite; the q/k window is read by every value head of the
group (Hv / Hk > 1), so the last of them to finish rewrites it, found by an arrival counter
per (row, key head) instead of any program waiting for another. Launch: 4 warps (on an H100,
K = V = 128: 8 warps or a head split in blocks of V were slower at batch 1, 64 and 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2, pdl, pdl_sync
from .causal_conv1d import causal_conv1d, causal_conv1d_ref
from .gated_delta_rule import gates
from .gated_delta_rule_recurrent import gated_delta_rule_recurrent, gated_delta_rule_recurrent_ref
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_ref
from .rms_norm import normed_rows


@triton.jit
def _conv_silu(x_row, w_ptr, window, c, cmask, has_init, stride_w, stride_sw,
               W: tl.constexpr, BLOCK: tl.constexpr):
    """One token's conv + SiLU over channels c (BLOCK,), as causal_conv1d sums it: taps 0..W-2
    from the window's rows (zeros without one), tap W-1 from x; rounded to x's dtype (float32
    values)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(window + j * stride_sw + c, mask=cmask & (c * 0 + has_init != 0),
                    other=0.0)
        w = tl.load(w_ptr + c * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
        acc += s.to(tl.float32) * w
    xv = tl.load(x_row + c, mask=cmask, other=0.0)
    w = tl.load(w_ptr + c * stride_w + (W - 1), mask=cmask, other=0.0).to(tl.float32)
    acc += xv.to(tl.float32) * w
    y = acc.to(xv.dtype).to(tl.float32)  # HF: the conv's output dtype, then SiLU
    y = y / (1.0 + tl.exp(-y))
    return y.to(xv.dtype).to(tl.float32)


@triton.jit
def _shift_window(window, x_row, c, cmask, has_init, stride_sw, W: tl.constexpr,
                  BW: tl.constexpr):
    """Writes the window after this token over channels c: old rows 1..W-2 (zeros without a
    window), then x (read again: cheaper than keeping it live). No program may read these
    channels' window after this."""
    i = tl.arange(0, BW)
    keep = (i + 1 < W - 1) & (i * 0 + has_init != 0)  # old rows 1..W-2 where there are some
    old = tl.load(window + (i + 1)[:, None] * stride_sw + c[None, :],
                  mask=keep[:, None] & cmask[None, :], other=0.0)
    xv = tl.load(x_row + c, mask=cmask, other=0.0)
    rows = tl.where((i == W - 2)[:, None], xv.to(tl.float32)[None, :], old.to(tl.float32))
    tl.debug_barrier()  # every read of the old window is done
    tl.store(window + i[:, None] * stride_sw + c[None, :], rows.to(window.dtype.element_ty),
             mask=(i < W - 1)[:, None] & cmask[None, :])


@triton.jit
def _gated_delta_decode_kernel(
    x_ptr, z_ptr, a_ptr, b_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr, out_ptr, conv_ptr, state_ptr,
    slot_ptr, init_ptr, count_ptr, K, V, key_dim, num_k_heads, scale, eps,
    stride_x, stride_zt, stride_zh, stride_at, stride_bt, stride_cw, stride_ot, stride_oh,
    stride_cn, stride_cs, stride_sn, stride_sh, stride_sk,
    GROUP: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr,
    ROUND_WEIGHTED: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)
    t, h = tl.program_id(0), tl.program_id(1)
    hk = h // GROUP
    t64 = t.to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    has_init = tl.where(slot >= 0, tl.load(init_ptr + t).to(tl.int32), 0)  # 0 or 1
    x_row = x_ptr + t64 * stride_x
    window = conv_ptr + slot * stride_cn
    kk = tl.arange(0, BK)
    vv = tl.arange(0, BV)
    kmask, vmask = kk < K, vv < V
    # The state first: its load (the bulk of the traffic) overlaps the conv below.
    s_ptrs = state_ptr + slot * stride_sn + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s_mask = kmask[:, None] & vmask[None, :]
    S = tl.load(s_ptrs, mask=s_mask & (kk[:, None] * 0 + has_init != 0), other=0.0)
    S = S.to(tl.float32)
    # Conv + SiLU of the key head's q and k (each value head of the group recomputes them: a
    # few taps) and of the head's v channels, whose window is this program's alone.
    cq, ck, cv = hk * K + kk, key_dim + hk * K + kk, 2 * key_dim + h * V + vv
    q = _conv_silu(x_row, cw_ptr, window, cq, kmask, has_init, stride_cw, stride_cs, W, BK)
    k = _conv_silu(x_row, cw_ptr, window, ck, kmask, has_init, stride_cw, stride_cs, W, BK)
    v = _conv_silu(x_row, cw_ptr, window, cv, vmask, has_init, stride_cw, stride_cs, W, BV)
    if slot >= 0:
        _shift_window(window, x_row, cv, vmask, has_init, stride_cs, W, BW)
        if GROUP == 1:  # the q/k window's only reader (else see the end)
            _shift_window(window, x_row, cq, kmask, has_init, stride_cs, W, BW)
            _shift_window(window, x_row, ck, kmask, has_init, stride_cs, W, BW)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)  # l2norm in float32, q / sqrt(K)
    q = (q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)) * scale
    a = tl.load(a_ptr + t64 * stride_at + h)
    b = tl.load(b_ptr + t64 * stride_bt + h)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    gate, beta = gates(a, b, a_log, dt_bias, b_ptr.dtype.element_ty)
    # S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q   (S: (K, V) float32)
    S = S * tl.exp(gate)
    delta = (v - tl.sum(S * k[:, None], 0)) * beta  # (BV,)
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], 0)
    if slot >= 0:
        tl.debug_barrier()  # every read of the old state is done
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_mask)
    # gated_rms_norm's math on o rounded to x's dtype (as the chain stores it).
    ox = o.to(out_ptr.dtype.element_ty)[None, :]
    y = normed_rows(ox, nw_ptr, vv[None, :], V, eps)  # (1, BV) weight * norm(o), float32
    if ROUND_WEIGHTED:  # torch multiplies weight and norm in their common 16-bit dtype
        y = y.to(ox.dtype).to(tl.float32)
    zg = tl.load(z_ptr + t64 * stride_zt + h * stride_zh + vv[None, :], mask=vmask[None, :],
                 other=0.0).to(tl.float32)
    y = y * (zg * tl.sigmoid(zg))
    tl.store(out_ptr + t64 * stride_ot + h * stride_oh + vv[None, :],
             y.to(out_ptr.dtype.element_ty), mask=vmask[None, :])
    if GROUP > 1:
        # The q/k window, read by every value head of the group, is rewritten by the last to
        # be done with it: each program counts itself in after its reads (acq_rel: the last
        # sees them done), and the last resets the counter, so every launch finds zeros.
        tl.debug_barrier()  # every thread's reads of the window are done
        counter = count_ptr + t64 * num_k_heads + hk
        if tl.atomic_add(counter, 1, sem="acq_rel") == GROUP - 1:
            tl.store(counter, 0)
            if slot >= 0:
                _shift_window(window, x_row, cq, kmask, has_init, stride_cs, W, BW)
                _shift_window(window, x_row, ck, kmask, has_init, stride_cs, W, BW)


# Arrival counters (kernel above) of each (row, key head), zero between launches; per device,
# only ever grown (a CUDA graph keeps the buffer it captured, so a replaced one is kept too).
# Launches on one device must not overlap (a decode step's layers run in stream order).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device))
    return buffers[-1]


def gated_delta_decode(
    x: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    num_warps: int = 4,
) -> torch.Tensor:
    """See the module docstring. x, z, a, b may be strided views of the packed input projection
    (last dim contiguous)."""
    num_tokens, head_k, head_v, num_v_heads, num_k_heads, width = _check(
        x, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state,
        state_slots, has_initial_state)
    out = torch.empty((num_tokens, num_v_heads, head_v), dtype=x.dtype, device=x.device)
    group = num_v_heads // num_k_heads
    counters = _arrival_counters(x.device, num_tokens * num_k_heads) if group > 1 else x
    if num_tokens:
        _gated_delta_decode_kernel[(num_tokens, num_v_heads)](
            x, z, a, b, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, ssm_state,
            state_slots, has_initial_state, counters, head_k, head_v, num_k_heads * head_k,
            num_k_heads, head_k**-0.5, eps, x.stride(0), z.stride(0), z.stride(1), a.stride(0),
            b.stride(0), conv_weight.stride(0), out.stride(0), out.stride(1),
            conv_state.stride(0), conv_state.stride(1), ssm_state.stride(0), ssm_state.stride(1),
            ssm_state.stride(2),
            GROUP=group, W=width, BK=next_pow2(head_k), BV=next_pow2(head_v),
            BW=next_pow2(width - 1),
            ROUND_WEIGHTED=x.dtype != torch.float32 and norm_weight.dtype == x.dtype,
            num_warps=num_warps, **pdl(x.device),
        )
    return out


def _check(x, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state,
           state_slots, has_initial_state) -> tuple[int, int, int, int, int, int]:
    """The launcher's checks; returns (T, K, V, Hv, Hk, W)."""
    check(x.dim() == 2 and x.stride(1) == 1, "x must be (T, C) with a contiguous last dim")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    num_tokens, channels = x.shape
    check(ssm_state.dim() == 4 and ssm_state.stride(3) == 1 and ssm_state.dtype in FLOAT_DTYPES,
          "ssm_state must be (N, Hv, K, V) with a contiguous last dim")
    num_v_heads, head_k, head_v = ssm_state.shape[1:]
    key_dim = (channels - num_v_heads * head_v) // 2
    check(key_dim > 0 and channels == 2 * key_dim + num_v_heads * head_v
          and key_dim % head_k == 0, "x's channels must be 2 Hk K + Hv V")
    num_k_heads = key_dim // head_k
    check(num_v_heads % num_k_heads == 0, "Hv must be a multiple of Hk")
    check(z.shape == (num_tokens, num_v_heads, head_v) and z.stride(2) == 1 and z.dtype == x.dtype,
          "z must be (T, Hv, V) in x's dtype with a contiguous last dim")
    for name, t in (("a", a), ("b", b)):
        check(t.shape == (num_tokens, num_v_heads) and t.stride(1) == 1, f"{name} must be (T, Hv)")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check(t.shape == (num_v_heads,) and t.is_contiguous(), f"{name} must be (Hv,)")
    check(norm_weight.shape == (head_v,) and norm_weight.is_contiguous(), "norm_weight (V,)")
    check(conv_weight.dim() == 2 and conv_weight.shape[0] == channels
          and conv_weight.stride(1) == 1, "conv_weight must be (C, W) with a contiguous last dim")
    width = conv_weight.shape[1]
    check(2 <= width <= 8, f"kernel width {width} must be in [2, 8]")
    check(conv_state.dim() == 3 and conv_state.shape[1:] == (width - 1, channels)
          and conv_state.stride(2) == 1 and conv_state.dtype in FLOAT_DTYPES,
          "conv_state must be (N, W-1, C) with a contiguous last dim")
    check(state_slots.shape == (num_tokens,) and state_slots.dtype == torch.int32
          and state_slots.is_contiguous(), "state_slots must be (T,) int32: one token a row")
    check(has_initial_state.shape == (num_tokens,) and has_initial_state.is_contiguous(),
          "has_initial_state must be (T,)")
    tensors = [x, z, a, b, conv_weight, A_log, dt_bias, norm_weight, conv_state, ssm_state,
               state_slots, has_initial_state]
    check(len({t.device for t in tensors}) == 1, "all inputs must be on one device")
    return num_tokens, head_k, head_v, num_v_heads, num_k_heads, width


def _chain(conv, rule, norm, x, z, a, b, conv_weight, A_log, dt_bias, norm_weight, eps,
           conv_state, ssm_state, state_slots, has_initial_state, cu_seqlens) -> torch.Tensor:
    """The three ops the fused kernel replaces, as layers/gated_deltanet.py calls them."""
    num_tokens = x.shape[0]
    num_v_heads, head_k, head_v = ssm_state.shape[1:]
    key_dim = (x.shape[1] - num_v_heads * head_v) // 2
    mixed = conv(x, conv_weight, cu_seqlens, conv_state, state_slots, has_initial_state, 1)
    q, k, v = mixed.split([key_dim, key_dim, num_v_heads * head_v], dim=1)
    qk_shape = (num_tokens, key_dim // head_k, head_k)
    o = rule(q.view(qk_shape), k.view(qk_shape), v.view(num_tokens, num_v_heads, head_v), a, b,
             A_log, dt_bias, cu_seqlens, ssm_state, state_slots, has_initial_state)
    return norm(o, z, norm_weight, eps)


def gated_delta_decode_ref(*args) -> torch.Tensor:
    """Same contract (and arguments) in torch: the three ops' references composed."""
    cu_seqlens = torch.arange(args[0].shape[0] + 1, dtype=torch.int32, device=args[0].device)
    return _chain(causal_conv1d_ref, gated_delta_rule_recurrent_ref, gated_rms_norm_ref, *args,
                  cu_seqlens)


def gated_delta_decode_unfused(*args, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The three Triton kernels the fused one replaces, launched one after another (the
    baseline of `bench.py kernels`); cu_seqlens (T+1,) int32 = arange, made once by the caller
    as the step's metadata holds it."""
    return _chain(causal_conv1d, gated_delta_rule_recurrent, gated_rms_norm, *args, cu_seqlens)
