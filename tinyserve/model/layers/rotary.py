"""Rotary position embedding (neox style: rotate the two halves of each head), as HF computes it.

`compute_inv_freq` reproduces transformers' `ROPE_INIT_FUNCTIONS` (default, linear, llama3, yarn)
op for op, so the float32 frequencies match bit for bit. The cos/sin table for every position is
precomputed once in float32 and the rotation runs in float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tinyserve.kernels.rotary import rotary_embedding


def compute_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) float32 on CPU, attention_factor multiplying cos and sin)."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponents)  # theta^(-2i/d)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return inv_freq, 1.0
    factor = scaling.get("factor")
    if rope_type == "linear":  # positions / factor == frequencies / factor
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: wavelengths above old_len/low_freq_factor are divided by `factor`, below
    # old_len/high_freq_factor are kept, and in between blend linearly in old_len/wavelen.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, theta: float, s: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv 2309.00071): dims rotating more than beta_fast times over the original context
    # keep their frequency (extrapolate), those under beta_slow are divided by `factor`
    # (interpolate), a linear ramp blends the ones between; cos/sin are scaled by
    # attention_factor = 0.1 ln(factor) + 1 (or the mscale ratio, DeepSeek style).
    original_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / original_len

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, D/2): [x1 cos - x2 sin | x2 cos + x1 sin]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2), broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = compute_inv_freq(head_dim, theta, scaling, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)  # on the default device
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]  # (P, D/2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor  # (P, D)
        # Non-persistent: never in a checkpoint. Kept float32; don't .to(bf16) the model.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def bind(self, positions: torch.Tensor) -> BoundRotary:
        """The rotation at `positions` (T,) for one forward (the module has no forward)."""
        return BoundRotary(positions, self.cos_sin_cache)


@dataclass(slots=True)
class BoundRotary:
    """The rotation at the positions of one forward, shared by its layers: `rope(q, k)` rotates
    with the Triton kernel (in place) on the GPU, the torch reference elsewhere; fused kernels
    read `positions` and `cos_sin_cache` themselves."""

    positions: torch.Tensor  # (T,)
    cos_sin_cache: torch.Tensor  # (P, D) float32
    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: gathered once per forward

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.positions.is_cuda:
            return rotary_embedding(self.positions, q, k, self.cos_sin_cache)
        if self._cos_sin is None:
            self._cos_sin = self.cos_sin_cache[self.positions].chunk(2, dim=-1)
        cos, sin = self._cos_sin
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
