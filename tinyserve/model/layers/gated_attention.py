"""Gated attention (Qwen3.5, Qwen3-Next): GQA with zero-centred q/k RMSNorm, rotary on the first
`rotary_dim` dims of each head only (partial_rotary_factor), and a sigmoid output gate:
o_proj(attention(q, k, v) * sigmoid(gate)), where the checkpoint's q_proj yields [q_h | gate_h]
for each head h. The packed projection is [q (Hq D) | k (Hkv D) | v (Hkv D) | gate (Hq D)].

Partial rotary runs on the paged attention path unchanged (layers/attention.py, and on the GPU
the fused kernels/rope_store_kv.py): the loader permutes each q and k head's dims so that the
rotated pairs (i, i + R/2), i < R/2, sit at (i, i + D/2), and the pass-through dims pair up after
them; a full-width neox rotation whose table holds cos 1 and sin 0 past R/2 then rotates exactly
the rotary dims and copies the others bit for bit. A permutation applied to both q and k leaves
every score q.k unchanged; v, and so the output, keep HF's order. (The KV cache holds permuted
keys, which nothing outside this layer reads.) The table is (max_position, D) float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.attention import Attention
from tinyserve.model.layers.linear import Linear, ShapeMismatch, copy_checked
from tinyserve.model.layers.rotary import BoundRotary, RotaryEmbedding
from tinyserve.model.layers.zero_centred_norm import ZeroCentredRMSNorm


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """perm (D,) int64 with permuted[p] = original[perm[p]] (see the module docstring)."""
    half, rotary_half = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))  # D - R pass-through dims
    num = half - rotary_half
    first = [*range(rotary_half), *passed[:num]]
    second = [*range(rotary_half, rotary_dim), *passed[num:]]
    return torch.tensor(first + second, dtype=torch.int64)


class PartialRotaryEmbedding(RotaryEmbedding):
    """The (P, D) cos/sin table of a rotation of the first `rotary_dim` dims, laid out for
    `rotary_permutation`: the rotary frequencies first, then cos 1 / sin 0 (identity pairs)."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(rotary_dim, max_position, theta, scaling)  # (P, R)
        cos, sin = self.cos_sin_cache.chunk(2, dim=-1)  # (P, R/2) each
        pad = (cos.shape[0], (head_dim - rotary_dim) // 2)
        ones = torch.ones(pad, dtype=cos.dtype, device=cos.device)
        self.cos_sin_cache = torch.cat((cos, ones, sin, torch.zeros_like(ones)), dim=-1)


class GatedQKVLinear(Linear):
    """[q | k | v | gate] rows from the checkpoint's q_proj (per head [q_h | gate_h]), k_proj
    and v_proj (shard ids "q", "k", "v"); q and k rows permuted within each head."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        permutation: torch.Tensor,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, 2 * q_size + 2 * kv_size, bias)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_size = q_size + 2 * kv_size  # the gate's first row
        self.permutation = permutation
        for param in self.parameters():
            param.shard_ids = ("q", "k", "v")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rest, d = tuple(param.shape[1:]), self.head_dim  # weight (out, in) or bias (out,)
        perm = self.permutation.to(loaded.device)
        q, kv = self.q_size, self.kv_size
        if shard_id == "q":
            if loaded.shape != (2 * q, *rest):
                raise ShapeMismatch((2 * q, *rest), tuple(loaded.shape))
            heads = loaded.reshape(self.num_heads, 2, d, *rest)  # (Hq, [q | gate], D, in)
            copy_checked(param.data[:q], heads[:, 0][:, perm].reshape(q, *rest))
            copy_checked(param.data[self.qkv_size :], heads[:, 1].reshape(q, *rest))
        elif shard_id == "k":
            if loaded.shape != (kv, *rest):
                raise ShapeMismatch((kv, *rest), tuple(loaded.shape))
            heads = loaded.reshape(self.num_kv_heads, d, *rest)[:, perm]
            copy_checked(param.data[q : q + kv], heads.reshape(kv, *rest))
        else:
            assert shard_id == "v", f"unknown shard {shard_id!r}"
            copy_checked(param.data[q + kv : self.qkv_size], loaded)


def rotary_dim(config: ModelConfig) -> int:
    return int(config.head_dim * config.partial_rotary_factor)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.attn_output_gate, "gated attention without an output gate"
        head_dim, num_heads = config.head_dim, config.num_attention_heads
        perm = rotary_permutation(head_dim, rotary_dim(config))
        self.qkv_proj = GatedQKVLinear(
            config.hidden_size,
            head_dim,
            num_heads,
            config.num_key_value_heads,
            config.attention_bias,
            perm,
        )
        self.o_proj = Linear(num_heads * head_dim, config.hidden_size, config.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps, perm)
        self.k_norm = ZeroCentredRMSNorm(head_dim, config.rms_norm_eps, perm)
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, config.num_key_value_heads)

    def forward(self, x: torch.Tensor, rope: BoundRotary) -> torch.Tensor:
        """x (T, H) normed hidden -> (T, H)."""
        out = self.qkv_proj(x)  # (T, (2 Hq + 2 Hkv) D)
        size = self.qkv_proj.qkv_size
        qkv, gate = out[:, :size], out[:, size:]
        attn = self.attn(qkv, rope, self.q_norm, self.k_norm).flatten(1)  # (T, Hq D)
        return self.o_proj(attn * torch.sigmoid(gate))
