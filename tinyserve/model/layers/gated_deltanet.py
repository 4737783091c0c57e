"""Gated DeltaNet (Qwen3.5, Qwen3-Next linear attention): a fixed-size recurrent state per
sequence instead of KV. in_proj -> [qkv | z | b | a]; qkv -> causal conv1d + SiLU (a W-1 token
window carried per sequence) -> q, k, v heads; the gated delta rule (kernels/gated_delta_rule.py,
a (Hv, K, V) matrix carried per sequence); a gated RMSNorm with z; out_proj.

States live in the runner's state pool: `conv_state` (N, W-1, C) in the model dtype and
`ssm_state` (N, Hv, K, V) (float32 by default: HF keeps the recurrent state in float32), rows
indexed by slot (core/state_pool.py), assigned like Attention's KV views (`allocate_states`).
The forward context then gives `cu_seqlens_q`, `state_slots`, `has_initial_state` (and
`token_state_slots` on a speculative step). Decode-only steps and steps with per-token states
(any row carrying drafts: every row then goes token by token) take the recurrent kernel, others
the chunked one (any mix of prompt chunks and decode rows); a decode-only step runs conv, delta
rule and norm as one kernel (kernels/gated_delta_decode.py; on CPU its reference, the same three
references composed). With no state assigned, the
T tokens are one sequence from a zero state (a plain forward, as Attention without a cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tinyserve.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from tinyserve.kernels.gated_delta_decode import gated_delta_decode, gated_delta_decode_ref
from tinyserve.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_ref
from tinyserve.kernels.gated_delta_rule_recurrent import (
    gated_delta_rule_recurrent,
    gated_delta_rule_recurrent_ref,
)
from tinyserve.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref
from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import _current_metadata
from tinyserve.model.layers.linear import Linear, MergedLinear
from tinyserve.model.layers.norm import RMSNorm


class GatedRMSNorm(RMSNorm):
    """HF's Qwen3_5RMSNormGated: (w * norm(x).to(dtype)) * silu(gate) with the norm and the gate
    in float32, rounded to x's dtype at the end."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # CUDA: one kernel for the reference's eight ops (a decode step is launch-bound).
        norm = gated_rms_norm if x.is_cuda else gated_rms_norm_ref
        return norm(x, gate, self.weight, self.eps)


class DepthwiseConv(nn.Module):
    """Holds the conv1d weight (C, 1, W) under HF's name; the kernels take it as (C, W)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width), requires_grad=False)


@dataclass(slots=True)
class StepStates:
    """What a DeltaNet layer reads of one forward: the batch layout and its state rows."""

    cu_seqlens: torch.Tensor  # (B+1,) int32
    state_slots: torch.Tensor  # (B,) int32
    has_initial_state: torch.Tensor  # (B,) bool
    max_seqlen: int
    is_recurrent: bool  # decode / verify rows: the token-by-token kernel
    token_state_slots: torch.Tensor | None = None
    is_decode: bool = False  # one token a row, no per-token states: the fused decode kernel


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = config.linear_conv_kernel_dim
        hv = self.num_v_heads
        self.in_proj = MergedLinear(
            config.hidden_size,
            [self.conv_dim, self.value_dim, hv, hv],
            shard_ids=("qkv", "z", "b", "a"),
        )
        self.conv1d = DepthwiseConv(self.conv_dim, self.conv_width)
        # float32 whatever the model dtype: HF computes exp(A_log) and a + dt_bias in float32,
        # and a 16-bit checkpoint's values are exact in float32.
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size)
        # Plain attributes, not buffers: the runner assigns rows of its state pool.
        self.conv_state: torch.Tensor | None = None  # (N, W-1, conv_dim)
        self.ssm_state: torch.Tensor | None = None  # (N, Hv, K, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) normed hidden -> (T, H); reads and advances each sequence's state."""
        num_tokens = x.shape[0]
        hv, k_dim, v_dim = self.num_v_heads, self.head_k_dim, self.head_v_dim
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, hv, hv], dim=1)
        step, conv_state, ssm_state = self._step_states(x)
        if step.is_decode:  # a decode step is launch-bound: conv, delta rule and norm at once
            decode = gated_delta_decode if x.is_cuda else gated_delta_decode_ref
            o = decode(
                mixed,
                z.view(num_tokens, hv, v_dim),
                a,
                b,
                self.conv1d.weight.squeeze(1),
                self.A_log,
                self.dt_bias,
                self.norm.weight,
                self.norm.eps,
                conv_state,
                ssm_state,
                step.state_slots,
                step.has_initial_state,
            )  # (T, Hv, V)
            return self.out_proj(o.view(num_tokens, self.value_dim))
        conv = causal_conv1d if x.is_cuda else causal_conv1d_ref
        mixed = conv(
            mixed,
            self.conv1d.weight.squeeze(1),
            step.cu_seqlens,
            conv_state,
            step.state_slots,
            step.has_initial_state,
            step.max_seqlen,
            token_state_slots=step.token_state_slots,
        )  # (T, conv_dim), SiLU applied
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=1)
        args = (
            q.view(num_tokens, self.num_k_heads, k_dim),
            k.view(num_tokens, self.num_k_heads, k_dim),
            v.view(num_tokens, hv, v_dim),
            a,
            b,
            self.A_log,
            self.dt_bias,
            step.cu_seqlens,
            ssm_state,
            step.state_slots,
            step.has_initial_state,
        )
        if step.is_recurrent:
            rule = gated_delta_rule_recurrent if x.is_cuda else gated_delta_rule_recurrent_ref
            o = rule(*args, token_state_slots=step.token_state_slots)
        else:
            assert step.token_state_slots is None, "per-token states need a verify step"
            o = (gated_delta_rule_chunked if x.is_cuda else gated_delta_rule_ref)(*args)
        o = self.norm(o, z.view(num_tokens, hv, v_dim))  # (T, Hv, V)
        return self.out_proj(o.view(num_tokens, self.value_dim))

    def _step_states(self, x: torch.Tensor) -> tuple[StepStates, torch.Tensor, torch.Tensor]:
        if self.ssm_state is None:  # one sequence from zeros, its final state dropped
            n, device = x.shape[0], x.device
            step = StepStates(
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device),
                state_slots=torch.zeros(1, dtype=torch.int32, device=device),
                has_initial_state=torch.zeros(1, dtype=torch.bool, device=device),
                max_seqlen=n,
                is_recurrent=False,
            )
            conv_shape, ssm_shape = state_shapes_of(self)
            conv = torch.empty((1, *conv_shape), dtype=x.dtype, device=device)
            ssm = torch.empty((1, *ssm_shape), dtype=torch.float32, device=device)
            return step, conv, ssm
        md = _current_metadata()
        assert md.state_slots is not None, "a hybrid model's forward needs state_slots"
        is_recurrent = md.is_decode_only or md.token_state_slots is not None
        step = StepStates(
            cu_seqlens=md.cu_seqlens_q,
            state_slots=md.state_slots,
            has_initial_state=md.has_initial_state,
            max_seqlen=md.verify_query_len or (1 if md.is_decode_only else max(md.query_lens_cpu)),
            is_recurrent=is_recurrent,
            token_state_slots=md.token_state_slots,
            is_decode=md.is_decode_only and md.token_state_slots is None,
        )
        return step, self.conv_state, self.ssm_state


def state_shapes_of(layer: GatedDeltaNet) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One slot's (conv window (W-1, C), recurrent matrix (Hv, K, V)) of a layer."""
    return (
        (layer.conv_width - 1, layer.conv_dim),
        (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
    )


def state_bytes_per_slot(
    config: ModelConfig, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of one state slot over all DeltaNet layers: what sizes the state pool."""
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    conv = (config.linear_conv_kernel_dim - 1) * conv_dim * dtype.itemsize
    ssm = config.linear_num_value_heads * config.linear_key_head_dim
    ssm *= config.linear_value_head_dim * ssm_dtype.itemsize
    return config.layer_types.count("linear_attention") * (conv + ssm)


def allocate_states(
    model: nn.Module, num_slots: int, ssm_dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gives every DeltaNet layer of `model` state rows for `num_slots` slots (on the model's
    device; conv windows in the model dtype); returns the (conv, ssm) pairs, layer by layer.
    Rows need no zeroing: a sequence's first forward reads none (has_initial_state False)."""
    states = []
    for layer in model.modules():
        if isinstance(layer, GatedDeltaNet):
            weight = layer.out_proj.weight
            conv_shape, ssm_shape = state_shapes_of(layer)
            layer.conv_state = torch.empty(
                (num_slots, *conv_shape), dtype=weight.dtype, device=weight.device
            )
            layer.ssm_state = torch.empty(
                (num_slots, *ssm_shape), dtype=ssm_dtype, device=weight.device
            )
            states.append((layer.conv_state, layer.ssm_state))
    return states
