"""The fused Gated DeltaNet decode step (kernels/gated_delta_decode.py) against its reference,
the three ops' references composed: output, the conv windows and recurrent states written back,
padded rows (slot -1), rows without a state yet, groups of value heads per key head, sizes off
powers of two; and a decode step of the layer taking it with the layer's own arguments."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import BF16, DEVICE, F32, INTERP, assert_rel, needs_triton

from tinyserve.kernels import gated_delta_decode as fused
from tinyserve.kernels.gated_delta_decode import (
    gated_delta_decode,
    gated_delta_decode_ref,
    gated_delta_decode_unfused,
)

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]

NUM_SLOTS = 8
SLOTS = [6, 2, -1, 0, 5]  # row 2 is a padded row; slot 0's row starts from zeros
HAS_INIT = [True, True, True, False, True]
WRITTEN = [0, 2, 5, 6]


def pool_with_nan(shape, dtype, written: list[int]) -> torch.Tensor:
    """A state pool whose slots outside `written` hold NaN: reading one poisons the output."""
    pool = torch.full((NUM_SLOTS, *shape), float("nan"), dtype=dtype, device=DEVICE)
    pool[written] = (torch.randn(len(written), *shape, device=DEVICE) * 0.5).to(dtype)
    return pool


def decode_inputs(hk, hv, k, v, width, dtype, slots=SLOTS, has_init=HAS_INIT):
    """The fused kernel's arguments: x, z, b, a as column slices of one packed projection (as
    the layer's in_proj output), pools with NaN in every slot no row may read."""
    num = len(slots)
    channels = 2 * hk * k + hv * v
    proj = torch.randn(num, channels + hv * v + 2 * hv + 3, device=DEVICE).to(dtype)
    x, z, b, a, _ = proj.split([channels, hv * v, hv, hv, 3], dim=1)
    conv_weight = (torch.randn(channels, width, device=DEVICE) * 0.5).to(dtype)
    a_log = torch.empty(hv, device=DEVICE).uniform_(0.5, 8).log()
    dt_bias = torch.randn(hv, device=DEVICE) * 0.5
    norm_weight = (1 + 0.2 * torch.randn(v, device=DEVICE)).to(dtype)
    readable = [s for s, init in zip(slots, has_init, strict=True) if s >= 0 and init]
    conv_state = pool_with_nan((width - 1, channels), dtype, readable)
    ssm_state = pool_with_nan((hv, k, v), F32, readable)
    rows = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    init = torch.tensor(has_init, device=DEVICE)
    z = z.view(num, hv, v)
    weights = [conv_weight, a_log, dt_bias, norm_weight, 1e-6]
    return [x, z, a, b, *weights, conv_state, ssm_state, rows, init]


def run(fn, args):
    """fn on fresh copies of the pools: (output, conv pool, ssm pool)."""
    args = list(args)
    args[9], args[10] = args[9].clone(), args[10].clone()
    return fn(*args), args[9], args[10]


# (Hk, Hv, K, V, W): one value head per key head; two; three with K, V off powers of two and a
# kernel of width 3 (two window rows in a block of two).
SHAPES = [(2, 2, 16, 32, 4), (2, 4, 16, 16, 4), (1, 3, 24, 40, 3)]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hk{}-hv{}-k{}-v{}-w{}".format(*s))
def test_fused_decode_matches_the_chain(shape, dtype):
    args = decode_inputs(*shape, dtype)
    out, conv, ssm = run(gated_delta_decode, args)
    ref_out, ref_conv, ref_ssm = run(gated_delta_decode_ref, args)
    assert out.dtype == dtype and out.shape == args[1].shape
    assert_rel(out, ref_out, dtype)
    torch.testing.assert_close(conv[WRITTEN], ref_conv[WRITTEN], rtol=0, atol=0)  # copies
    assert_rel(ssm[WRITTEN], ref_ssm[WRITTEN], dtype)
    unused = [s for s in range(NUM_SLOTS) if s not in WRITTEN]
    assert conv[unused].isnan().all() and ssm[unused].isnan().all()  # nothing else written
    if INTERP:  # the three kernels' rounding order, step for step: equal bits on CPU
        cu_seqlens = torch.arange(len(SLOTS) + 1, dtype=torch.int32)
        unfused = lambda *a: gated_delta_decode_unfused(*a, cu_seqlens=cu_seqlens)  # noqa: E731
        chain_out, _, chain_ssm = run(unfused, args)
        assert torch.equal(out, chain_out)
        assert torch.equal(ssm[WRITTEN], chain_ssm[WRITTEN])
    # A group's q/k window is rewritten by its last value head to arrive, which leaves the
    # arrival counters at zero for the next launch.
    assert all(not c.any() for buffers in fused._COUNTERS.values() for c in buffers)


def test_fused_decode_without_states():
    """Every row from zeros (a fresh batch, or padded rows only): no slot is read."""
    slots, has_init = [3, -1, 1], [False, True, False]
    args = decode_inputs(2, 4, 16, 16, 4, F32, slots, has_init)
    out, conv, ssm = run(gated_delta_decode, args)
    ref_out, ref_conv, ref_ssm = run(gated_delta_decode_ref, args)
    assert_rel(out, ref_out, F32)
    torch.testing.assert_close(conv[[1, 3]], ref_conv[[1, 3]], rtol=0, atol=0)
    assert_rel(ssm[[1, 3]], ref_ssm[[1, 3]], F32)
    # The window after a first token: two zero rows, then the token's inputs.
    assert (conv[3, :2] == 0).all() and torch.equal(conv[3, 2], args[0][0])


def test_fused_decode_checks():
    args = decode_inputs(2, 4, 16, 16, 4, F32)
    x, z, a, b, conv_weight, *rest = args
    with pytest.raises(ValueError, match="channels"):
        gated_delta_decode(x[:, 1:], z, a, b, conv_weight[1:], *rest)
    with pytest.raises(ValueError, match="z must be"):
        gated_delta_decode(x, z[:, :2], a, b, conv_weight, *rest)
    with pytest.raises(ValueError, match="state_slots"):
        gated_delta_decode(*args[:11], args[11][:2], args[12])


def test_layer_decode_step_takes_the_fused_kernel(monkeypatch):
    """A decode step of GatedDeltaNet runs the fused op with the layer's own arguments (the
    Triton kernel in the reference's place on CPU): the same step as the three separate ops
    give, which a mixed step and a verify step (per-token states) still take."""
    from tinyserve.model.config import ModelConfig
    from tinyserve.model.layers import gated_deltanet as layer_module
    from tinyserve.model.layers.attention import AttentionMetadata, forward_context

    config = ModelConfig(
        path="",
        architecture="Qwen3_5ForCausalLM",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=["linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    layer = layer_module.GatedDeltaNet(config).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():  # O(1) activations: weights ~ N(0, 1 / fan_in)
            p.copy_(torch.randn(p.shape) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.2))
        layer.norm.weight.add_(1.0)
    ((conv_pool, ssm_pool),) = layer_module.allocate_states(layer, NUM_SLOTS)
    pools = torch.randn(conv_pool.shape, device=DEVICE), torch.randn(ssm_pool.shape, device=DEVICE)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    md = AttentionMetadata(
        slot_mapping=torch.zeros(3, dtype=torch.int64, device=DEVICE),
        block_tables=int32([[0]] * 3),
        cu_seqlens_q=int32([0, 1, 2, 3]),
        context_lens=int32([1] * 3),
        query_lens_cpu=[1] * 3,
        context_lens_cpu=[1] * 3,
        max_context_len=1,
        is_decode_only=True,
        state_slots=int32([4, 1, -1]),
        has_initial_state=torch.tensor([True, False, True], device=DEVICE),
    )
    x = torch.randn(3, 32, device=DEVICE)
    calls = []

    def step(decode_fn) -> tuple[torch.Tensor, ...]:
        """The layer's step from `pools`, its fused op (either device's) replaced by decode_fn."""
        spy = lambda *args: calls.append(decode_fn) or decode_fn(*args)  # noqa: E731
        for name in ("gated_delta_decode", "gated_delta_decode_ref"):
            monkeypatch.setattr(layer_module, name, spy)
        conv_pool.copy_(pools[0])
        ssm_pool.copy_(pools[1])
        with forward_context(md), torch.no_grad():
            out = layer(x)
        return out, conv_pool.clone(), ssm_pool.clone()

    ref = step(gated_delta_decode_ref)
    ours = step(gated_delta_decode)
    assert calls == [gated_delta_decode_ref, gated_delta_decode]
    for a, b in zip(ours, ref, strict=True):
        assert_rel(a, b, F32)
    # The same rows as a mixed step take the three ops (the chunked rule): the same step.
    md.is_decode_only = False
    for a, b in zip(step(gated_delta_decode), ref, strict=True):
        assert_rel(a, b, F32)
    md.token_state_slots, md.verify_query_len = int32([5, 6, -1]), 1  # a verify step
    step(gated_delta_decode)
    assert len(calls) == 2  # neither took the fused op
