"""The Gated DeltaNet kernels (causal conv1d, the chunked and the recurrent gated delta rule)
against their torch references: varlen batches, state carried in and out of pool slots, chunk
boundaries off the kernel's chunk grid, a sequence split into chunks, verify steps keeping the
state after every token, and the launchers' input checks."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import BF16, DEVICE, F32, assert_rel, needs_triton

from tinyserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from tinyserve.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_ref
from tinyserve.kernels.gated_delta_rule_recurrent import (
    gated_delta_rule_recurrent,
    gated_delta_rule_recurrent_ref,
)

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]

NUM_SLOTS = 8


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE)


def int32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def pool_with_nan(shape, dtype, written: list[int]) -> torch.Tensor:
    """A state pool whose slots outside `written` hold NaN: reading one poisons the output."""
    pool = torch.full((NUM_SLOTS, *shape), float("nan"), dtype=dtype, device=DEVICE)
    pool[written] = (torch.randn(len(written), *shape, device=DEVICE) * 0.5).to(dtype)
    return pool


# -- causal conv1d ----------------------------------------------------------------------------

CONV_C, CONV_W = 48, 4


def conv_inputs(lens, dtype):
    """x as a column slice of a wider projection (strided rows), weight (C, W)."""
    proj = torch.randn(sum(lens), CONV_C + 10, device=DEVICE).to(dtype)
    return proj[:, 6 : 6 + CONV_C], (torch.randn(CONV_C, CONV_W, device=DEVICE) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_causal_conv1d_varlen_with_states(dtype):
    # 70 tokens cross the kernel's 64-token blocks; a 2-token sequence is shorter than the
    # window (its new window keeps one row of the old); slot -1 runs without a state.
    lens = [5, 1, 70, 2, 3]
    x, weight = conv_inputs(lens, dtype)
    slots, init = int32([3, 7, 0, 5, -1]), torch.tensor([True, True, False, True, True])
    state = pool_with_nan((CONV_W - 1, CONV_C), dtype, written=[3, 5, 7])
    args = (x, weight, cu_seqlens(lens))
    ours, ref = state.clone(), state.clone()
    out = causal_conv1d(*args, ours, slots, init.to(DEVICE), max(lens))
    expected = causal_conv1d_ref(*args, ref, slots, init.to(DEVICE), max(lens))
    assert_rel(out, expected, dtype)
    written = [0, 3, 5, 7]
    assert_rel(ours[written], ref[written], dtype)
    assert ours[[1, 2, 4, 6]].isnan().all()  # other slots untouched


def test_causal_conv1d_chunks_carry_the_window():
    """A sequence run as chunks 1 + 6 + 9, the window carried in the pool, equals one pass."""
    x, weight = conv_inputs([16], F32)
    whole = causal_conv1d(
        x,
        weight,
        cu_seqlens([16]),
        torch.zeros(1, 3, CONV_C, device=DEVICE),
        int32([0]),
        torch.tensor([False], device=DEVICE),
        16,
    )
    state = pool_with_nan((CONV_W - 1, CONV_C), F32, written=[])
    parts, start = [], 0
    for n in (1, 6, 9):
        init = torch.tensor([start > 0], device=DEVICE)
        parts.append(
            causal_conv1d(x[start : start + n], weight, cu_seqlens([n]), state, int32([2]), init, n)
        )
        start += n
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state[2], x[-3:].float())


def test_causal_conv1d_token_states():
    """A verify step keeps the window after each token in its own slot; the read slot stays."""
    lens = [3, 2]
    x, weight = conv_inputs(lens, F32)
    state = pool_with_nan((CONV_W - 1, CONV_C), F32, written=[0, 1])
    tokens = int32([2, 3, 4, 5, -1])  # the second sequence keeps only its first token's
    ours, ref = state.clone(), state.clone()
    args = (x, weight, cu_seqlens(lens))
    init = torch.tensor([True, True], device=DEVICE)
    out = causal_conv1d(*args, ours, int32([0, 1]), init, 3, token_state_slots=tokens)
    expected = causal_conv1d_ref(*args, ref, int32([0, 1]), init, 3, token_state_slots=tokens)
    assert_rel(out, expected, F32)
    assert_rel(ours[:6], ref[:6], F32)
    torch.testing.assert_close(ours[:2], state[:2])  # read slots unchanged
    # The window after the first sequence's last token: its 3 inputs.
    torch.testing.assert_close(ours[4], x[:3].float())


def test_causal_conv1d_checks():
    x, weight = conv_inputs([4], F32)
    state = torch.zeros(2, CONV_W - 1, CONV_C, device=DEVICE)
    ok = (cu_seqlens([4]), state, int32([0]), torch.tensor([False], device=DEVICE), 4)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:-1], *ok)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, ok[0], state[:, :2], *ok[2:])
    with pytest.raises(ValueError, match="state_slots"):
        causal_conv1d(x, weight, ok[0], state, int32([0, 1]), *ok[3:])


# -- the gated delta rule ---------------------------------------------------------------------

HK, HV, K, V = 2, 4, 16, 32  # two value heads per key head


def rule_inputs(lens, dtype):
    """q, k, v, a, b as column slices of one packed projection, as the model passes them."""
    n = sum(lens)
    widths = [HK * K, HK * K, HV * V, HV, HV]
    proj = torch.randn(n, sum(widths) + 3, device=DEVICE).to(dtype)
    q, k, v, a, b, _ = proj.split([*widths, 3], dim=1)
    a_log = torch.empty(HV, device=DEVICE).uniform_(0.5, 8).log()  # decays up to exp(-8 ...)
    dt_bias = torch.randn(HV, device=DEVICE) * 0.5
    return (q.view(n, HK, K), k.view(n, HK, K), v.view(n, HV, V), a, b, a_log, dt_bias)


def run(fn, inputs, lens, state, slots, init, **kwargs):
    state = state.clone()
    out = fn(
        *inputs, cu_seqlens(lens), state, int32(slots), torch.tensor(init, device=DEVICE), **kwargs
    )
    return out, state


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_chunked_rule_varlen_with_states(dtype):
    # Chunks of 16: 17 and 40 tokens end off the grid, 1 and 5 fit in one partial chunk.
    lens = [5, 1, 40, 17, 3]
    inputs = rule_inputs(lens, dtype)
    slots, init = [3, 7, 0, 5, -1], [True, True, False, True, True]
    state = pool_with_nan((HV, K, V), F32, written=[3, 5, 7])
    out, ours = run(gated_delta_rule_chunked, inputs, lens, state, slots, init, chunk_size=16)
    ref_out, ref = run(gated_delta_rule_ref, inputs, lens, state, slots, init, chunk_size=16)
    rec_out, rec = run(gated_delta_rule_recurrent_ref, inputs, lens, state, slots, init)
    assert_rel(out, ref_out, dtype)
    written = [0, 3, 5, 7]
    assert_rel(ours[written], ref[written], dtype)  # float32 states of 16-bit inputs
    # The chunkwise reference is the token-by-token recurrence (HF's two forms agree).
    assert_rel(ref_out, rec_out, dtype)
    assert_rel(ref[written], rec[written], dtype)
    assert ours[[1, 2, 4, 6]].isnan().all()


def test_chunked_rule_chunks_carry_the_state():
    """A 37-token sequence run as chunks 1 + 20 + 16 (kernel chunks of 16) through a pool slot
    equals one pass, as does a bf16 state pool within its rounding."""
    inputs = rule_inputs([37], F32)
    whole, whole_state = run(
        gated_delta_rule_chunked,
        inputs,
        [37],
        torch.zeros(1, HV, K, V, device=DEVICE),
        [0],
        [False],
        chunk_size=16,
    )
    for pool_dtype in (F32, BF16):
        state = pool_with_nan((HV, K, V), pool_dtype, written=[])
        parts, start = [], 0
        for n in (1, 20, 16):
            piece = [x[start : start + n] for x in inputs[:5]] + list(inputs[5:])
            parts.append(
                gated_delta_rule_chunked(
                    *piece,
                    cu_seqlens([n]),
                    state,
                    int32([4]),
                    torch.tensor([start > 0], device=DEVICE),
                    chunk_size=16,
                )
            )
            start += n
        assert_rel(torch.cat(parts), whole, pool_dtype)
        assert_rel(state[4], whole_state[0], pool_dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_recurrent_rule_decode(dtype):
    lens = [1] * 5
    inputs = rule_inputs(lens, dtype)
    slots, init = [6, 2, 0, 1, -1], [True, True, False, True, False]
    state = pool_with_nan((HV, K, V), F32, written=[1, 2, 6])
    out, ours = run(gated_delta_rule_recurrent, inputs, lens, state, slots, init, block_v=16)
    ref_out, ref = run(gated_delta_rule_recurrent_ref, inputs, lens, state, slots, init)
    assert_rel(out, ref_out, dtype)
    assert_rel(ours[[0, 1, 2, 6]], ref[[0, 1, 2, 6]], dtype)


def test_recurrent_rule_verify_keeps_every_state():
    """k + 1 = 3 tokens per sequence: the state after token j lands in its slot and equals
    the state after j + 1 decode steps; the sequences' own slots are only read."""
    lens = [3, 3]
    inputs = rule_inputs(lens, F32)
    state = pool_with_nan((HV, K, V), F32, written=[0, 1])
    tokens = int32([2, 3, 4, 5, 6, 7])
    out, ours = run(
        gated_delta_rule_recurrent,
        inputs,
        lens,
        state,
        [0, 1],
        [True, True],
        token_state_slots=tokens,
    )
    ref_out, ref = run(
        gated_delta_rule_recurrent_ref,
        inputs,
        lens,
        state,
        [0, 1],
        [True, True],
        token_state_slots=tokens,
    )
    assert_rel(out, ref_out, F32)
    assert_rel(ours[2:], ref[2:], F32)
    torch.testing.assert_close(ours[:2], state[:2])
    # Step by step: decode rows of the two sequences, token j of each.
    step_state = state.clone()
    for j in range(3):
        rows = [x[[j, 3 + j]] for x in inputs[:5]] + list(inputs[5:])
        gated_delta_rule_recurrent(
            *rows,
            cu_seqlens([1, 1]),
            step_state,
            int32([0, 1]),
            torch.tensor([True, True], device=DEVICE),
        )
        torch.testing.assert_close(ours[[2 + j, 5 + j]], step_state[:2], rtol=1e-5, atol=1e-5)


def test_rule_checks():
    inputs = rule_inputs([2], F32)
    state = torch.zeros(1, HV, K, V, device=DEVICE)
    rest = (cu_seqlens([2]), state, int32([0]), torch.tensor([False], device=DEVICE))
    q, k, v, a, b, a_log, dt_bias = inputs
    with pytest.raises(ValueError, match="Hv must be a multiple"):
        gated_delta_rule_chunked(q, k, v[:, :3], a[:, :3], b[:, :3], a_log[:3], dt_bias[:3], *rest)
    with pytest.raises(ValueError, match="ssm_state"):
        gated_delta_rule_recurrent(*inputs, rest[0], state[:, :, :8], *rest[2:])
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule_chunked(*inputs, *rest, chunk_size=24)


# -- gated RMSNorm ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gated_rms_norm_matches_the_layer(dtype):
    """One kernel for the eight-op norm: the layer's math, with a gate that is a strided view
    of a wider projection (as `in_proj`'s z is), and the weight's rounding in 16-bit dtypes."""
    from tinyserve.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref

    T, H, N = 5, 4, 128
    x = torch.randn(T, H, N, device=DEVICE).to(dtype)
    proj = torch.randn(T, H * N + 40, device=DEVICE).to(dtype)
    gate = proj[:, 8 : 8 + H * N].view(T, H, N)
    weight = (1 + 0.1 * torch.randn(N, device=DEVICE)).to(dtype)
    out = gated_rms_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype and out.shape == (T, H, N)
    assert_rel(out, gated_rms_norm_ref(x, gate, weight, 1e-6), dtype)
    with pytest.raises(ValueError):
        gated_rms_norm(x, gate[:2], weight, 1e-6)
