"""Token embedding and LM head. A tied head shares the embedding's weight Parameter (the model
assigns it), so it exists once in named_parameters() and the loader writes it once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.gemv import gemv
from tinyserve.kernels.gemv_config import gemv_method

# torch.mm(..., out_dtype=torch.float32) on CUDA: torch 2.8 and later (pyproject allows 2.4).
_MM_FLOAT_OUT = torch.__version__ >= "2.8"


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num_embeddings, embedding_dim), requires_grad=False
        )  # (V, H)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits (N, V), into `out` if given. On CUDA the gemv and cuBLAS write their
        float32 accumulators directly (rounded once); elsewhere the matmul runs in the model
        dtype, then float (HF's logits.float()). A bf16 result plus its float32 copy moves the
        logits' bytes 2.5x (a 152k-vocabulary head 10% slower at 128 rows)."""
        (m, _), v = hidden.shape, self.weight.shape[0]
        method = gemv_method(m, v, hidden.shape[1]) if hidden.is_cuda else None
        if method:
            if out is None:
                out = torch.empty(m, v, dtype=torch.float32, device=hidden.device)
            return gemv(hidden, self.weight, out, method=method)
        if _MM_FLOAT_OUT and hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(hidden, self.weight.t(), out_dtype=torch.float32, out=out)
        if out is None:
            return F.linear(hidden, self.weight).float()
        return out.copy_(F.linear(hidden, self.weight))
