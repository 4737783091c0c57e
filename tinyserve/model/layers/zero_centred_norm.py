"""RMSNorm with a zero-centred weight (Qwen3.5, Qwen3-Next): y = norm(x) * (1 + w), as HF's
Qwen3_5RMSNorm: normalised and scaled in float32, rounded to x's dtype once, at the end.

The parameter holds 1 + w in float32 (the loader adds the 1 as it copies the checkpoint's w, in
float32 as HF does), so the forward is HF's arithmetic bit for bit, dummy weights of 1 are the
untrained norm, and the fused kernels that take a norm weight (kernels/rope_store_kv.py) read a
plain float32 scale. `permutation` reorders the weight as it loads (the q/k norms of
layers/gated_attention.py). `norm(x, residual)` -> (norm(x + residual), x + residual), the add in
x's dtype, as layers/norm.py. On CUDA one fused Triton pass (kernels/rms_norm.py, `round_last`):
the torch ops below are ~7 kernels a norm, two norms a layer, most of a small model's decode step.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.kernels.rms_norm import rms_norm
from tinyserve.model.layers.linear import ShapeMismatch, copy_checked
from tinyserve.model.layers.norm import RMSNorm


class ZeroCentredRMSNorm(RMSNorm):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, permutation: torch.Tensor | None = None
    ) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        self.permutation = permutation  # (hidden_size,) CPU int64, or None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        assert shard_id is None, "unpacked parameter loaded with a shard id"
        if loaded.shape != param.shape:
            raise ShapeMismatch(tuple(param.shape), tuple(loaded.shape))
        w = loaded.float()
        if self.permutation is not None:
            w = w[self.permutation.to(w.device)]
        copy_checked(param.data, 1.0 + w)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual, round_last=True)
        return zero_centred_rms_norm_ref(x, self.weight, self.eps, residual)


def zero_centred_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's Qwen3_5RMSNorm with `weight` = 1 + w (float32)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = (normed * weight).to(x.dtype)
    return out if residual is None else (out, residual)
