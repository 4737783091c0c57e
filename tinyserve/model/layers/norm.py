"""RMSNorm with an optional fused residual add, numerically as HF's LlamaRMSNorm.

`norm(x)` -> normed; `norm(x, residual)` -> (norm(x + residual), x + residual). The add happens
in the input dtype (as HF's decoder layer), the normalisation in float32, then the result is cast
back to the input dtype before the weight multiplies it (HF's order, which matters in bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.kernels.rms_norm import rms_norm, rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # one fused Triton pass (add + norm + scale) instead of ~6 torch ops
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)
