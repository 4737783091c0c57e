"""Causal depthwise conv1d + SiLU over packed sequences, carrying each sequence's conv window.

`causal_conv1d(x (T, C), weight (C, W), cu_seqlens (B+1,), conv_state (N, W-1, C),
state_slots (B,), has_initial_state (B,), max_seqlen)` -> (T, C) in x's dtype:
out[t, c] = silu(sum_j weight[c, j] * x[t - (W-1) + j, c]), where positions before a sequence's
first token read its window conv_state[slot] (zeros when has_initial_state is False or the slot
is negative). The window after the sequence's last token (its last W-1 inputs) is written back to
the slot. One launch serves prefill chunks and one-token decode rows alike. A verify step passes
`token_state_slots` (T,): the window after each token goes to that slot (-1: not kept) and the
sequence's own slot is only read (it must differ from every slot written). As HF, the sum is
rounded to x's dtype before the SiLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2


@triton.jit
def _window_rows(x_ptr, state_ptr, seq_start, t, c, cmask, tmask, has_init, stride_x, stride_sw,
                 BACK: tl.constexpr, WIN: tl.constexpr):
    """Inputs at positions t - BACK (BLOCK_T,) of a sequence as (BLOCK_T, BLOCK_C) float32: from
    x at non-negative positions, else from the slot's window (state_ptr: row WIN + u holds
    position u < 0), zeros without one."""
    u = t - BACK
    from_x = u >= 0
    xv = tl.load(x_ptr + (seq_start + u)[:, None] * stride_x + c[None, :],
                 mask=(tmask & from_x)[:, None] & cmask[None, :], other=0.0)
    sv = tl.load(state_ptr + (u + WIN)[:, None] * stride_sw + c[None, :],
                 mask=(tmask & (u < 0) & (u * 0 + has_init != 0))[:, None] & cmask[None, :],
                 other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, tok_slot_ptr,
    C, stride_x, stride_o, stride_w, stride_sn, stride_sw,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BIAS: tl.constexpr, TOKEN_STATES: tl.constexpr, SILU: tl.constexpr,
):
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    start = tl.load(cu_ptr + b)
    seq_len = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    has_init = tl.where(slot >= 0, tl.load(init_ptr + b).to(tl.int32), 0)  # 0 or 1
    t = t0 + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = t < seq_len
    cmask = c < C
    # The first W-1 positions read the window, so only the t0 == 0 program reads the slot
    # (BLOCK_T >= W-1); it is also the one that writes the new window, after a barrier.
    window = state_ptr + slot * stride_sn
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        xj = _window_rows(x_ptr, window, start, t, c, cmask, tmask, has_init, stride_x,
                          stride_sw, W - 1 - j, W - 1)
        wj = tl.load(w_ptr + c * stride_w + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xj * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # HF: the conv's output dtype, then SiLU
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + (start + t)[:, None] * stride_o + c[None, :],
             y.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])

    if TOKEN_STATES:  # the window after token t: positions t-W+2 .. t, to its own slot
        tok_slot = tl.load(tok_slot_ptr + start + t, mask=tmask, other=-1).to(tl.int64)
        keep = tmask & (tok_slot >= 0)
        for i in tl.static_range(W - 1):
            xi = _window_rows(x_ptr, window, start, t, c, cmask, tmask, has_init, stride_x,
                              stride_sw, W - 2 - i, W - 1)
            tl.store(state_ptr + tok_slot[:, None] * stride_sn + i * stride_sw + c[None, :],
                     xi.to(state_ptr.dtype.element_ty), mask=keep[:, None] & cmask[None, :])
    else:
        if t0 == 0:
            if slot >= 0:  # the new window: positions seq_len-W+1 .. seq_len-1
                i = tl.arange(0, BLOCK_W)
                rows = _window_rows(x_ptr, window, start, seq_len - (W - 1) + i, c, cmask,
                                    i < W - 1, has_init, stride_x, stride_sw, 0, W - 1)
                tl.debug_barrier()  # every read of the old window is done
                tl.store(window + i[:, None] * stride_sw + c[None, :],
                         rows.to(state_ptr.dtype.element_ty),
                         mask=(i < W - 1)[:, None] & cmask[None, :])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_seqlen: int,
    bias: torch.Tensor | None = None,
    token_state_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    activation: bool = True,
) -> torch.Tensor:
    """See the module docstring. x may be a column slice of a wider projection (its last dim
    contiguous); `max_seqlen` (host int) bounds the longest sequence of the batch."""
    check(x.dim() == 2 and x.stride(1) == 1, "x must be (T, C) with a contiguous last dim")
    check(x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}")
    num_tokens, channels = x.shape
    check(weight.dim() == 2 and weight.shape[0] == channels and weight.stride(1) == 1,
          "weight must be (C, W) with a contiguous last dim")
    width = weight.shape[1]
    check(2 <= width <= 8, f"kernel width {width} must be in [2, 8]")
    check(conv_state.dim() == 3 and conv_state.shape[1:] == (width - 1, channels),
          "conv_state must be (N, W-1, C)")
    check(conv_state.stride(2) == 1, "conv_state needs a contiguous last dim")
    check(conv_state.dtype in FLOAT_DTYPES, f"unsupported conv_state dtype {conv_state.dtype}")
    batch = cu_seqlens.shape[0] - 1
    check(cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous(), "cu_seqlens int32")
    check(state_slots.shape == (batch,) and state_slots.dtype == torch.int32, "state_slots (B,)")
    check(has_initial_state.shape == (batch,), "has_initial_state must be (B,)")
    check(state_slots.is_contiguous() and has_initial_state.is_contiguous(), "slots contiguous")
    if bias is not None:
        check(bias.shape == (channels,) and bias.is_contiguous(), "bias must be (C,)")
    if token_state_slots is not None:
        check(token_state_slots.shape == (num_tokens,) and token_state_slots.is_contiguous()
              and token_state_slots.dtype == torch.int32, "token_state_slots must be (T,) int32")
    if out is None:
        out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    check(out.shape == x.shape and out.dtype == x.dtype and out.stride(1) == 1, "bad out")
    tensors = [x, weight, cu_seqlens, conv_state, state_slots, has_initial_state, out]
    check(len({t.device for t in tensors}) == 1, "all inputs must be on one device")
    block_t = max(next_pow2(width - 1), min(64, next_pow2(max(max_seqlen, 1))))
    block_c = min(128, next_pow2(channels))
    if batch and num_tokens:
        grid = (batch, triton.cdiv(max(max_seqlen, 1), block_t), triton.cdiv(channels, block_c))
        _causal_conv1d_kernel[grid](
            x, weight, bias if bias is not None else weight, out, conv_state, cu_seqlens,
            state_slots, has_initial_state,
            token_state_slots if token_state_slots is not None else state_slots,
            channels, x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0),
            conv_state.stride(1),
            W=width, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_W=next_pow2(width - 1),
            HAS_BIAS=bias is not None, TOKEN_STATES=token_state_slots is not None,
            SILU=activation, num_warps=4,
        )
    return out


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_seqlen: int = 0,
    bias: torch.Tensor | None = None,
    token_state_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    activation: bool = True,
) -> torch.Tensor:
    """Same contract in torch, one sequence at a time (`max_seqlen` unused); equal-length
    batches (decode) run as one."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    cu = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(cu, cu[1:], strict=False)]
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device) if out is None else out
    slots = state_slots.long()
    use = has_initial_state.bool() & (slots >= 0)
    # (B, W-1, C) windows before each sequence, float32; zeros where there is none (a where,
    # not a product: an unused slot may hold NaN).
    before = conv_state[slots.clamp(min=0)].float()
    before = torch.where(use[:, None, None], before, torch.zeros_like(before))
    if len(set(lens)) == 1 and lens[0] > 0:  # (B, L, C) as one batch
        groups = [(list(range(len(lens))), cu[0], lens[0])]
    else:
        groups = [([i], cu[i], n) for i, n in enumerate(lens) if n > 0]
    for rows, start, n in groups:
        xs = x[start : start + n * len(rows)].float().view(len(rows), n, channels)
        xs = torch.cat([before[rows], xs], dim=1)  # (b, W-1+L, C)
        y = (xs.unfold(1, width, 1) * weight.float()).sum(-1)  # (b, L, C)
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
        if activation:
            y = F.silu(y.float()).to(x.dtype)
        out[start : start + n * len(rows)] = y.reshape(-1, channels)
        for r, seq in enumerate(rows):
            if token_state_slots is not None:
                for i in range(n):
                    s = int(token_state_slots[cu[seq] + i])
                    if s >= 0:
                        conv_state[s] = xs[r, i + 1 : i + width].to(conv_state.dtype)
            elif slots[seq] >= 0:
                conv_state[slots[seq]] = xs[r, -(width - 1) :].to(conv_state.dtype)
    return out
