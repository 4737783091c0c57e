"""Linear layers whose parameters know how to load themselves from HF checkpoint tensors.

Every parameter carries `weight_loader(param, tensor, shard_id)`. `QKVLinear` packs q, k, v
(shard ids "q", "k", "v") and `MergedLinear` packs e.g. gate and up (shard ids 0, 1) into one
weight so each runs as one matmul; `param.shard_ids` lists the shards the loader must fill.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.gemv import SplitSum, gemv
from tinyserve.kernels.gemv_config import gemv_method, norm_prologue_pays, silu_mul_epilogue
from tinyserve.model.layers.activation import silu_and_mul


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not fit its destination; the loader adds the tensor name."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]) -> None:
        super().__init__(f"expected shape {expected}, checkpoint has {got}")
        self.expected = expected
        self.got = got


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (cast and moved by copy_, so the source may sit on the host in any dtype)."""
    if dst.shape != src.shape:
        raise ShapeMismatch(tuple(dst.shape), tuple(src.shape))
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    assert shard_id is None, "unpacked parameter loaded with a shard id"
    copy_checked(param.data, loaded)


class Linear(nn.Module):
    """y = x W^T (+ b); W is (output_size, input_size) as in HF."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        # torch.empty: the loader (or dummy init) writes every element, so skip nn.Linear's init.
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded, shard_id)

    def _gemv_method(self, x: torch.Tensor) -> str | None:
        # Decode batches: the Triton gemv streams weights faster than cuBLAS, and its "stream"
        # variant's prologues fuse the norm / activation that feeds the matmul.
        return gemv_method(x.shape[0], *self.weight.shape) if x.is_cuda else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self._gemv_method(x))

    def unreduced(self, x: torch.Tensor) -> torch.Tensor | SplitSum:
        """self(x), but where x's rows take the split-K kernel, its partials not yet summed: for
        an RMSNorm (or `SplitSum.reduce`) to sum, a kernel less than summing them here."""
        method = self._gemv_method(x)
        if method == "split":
            return gemv(x, self.weight, bias=self.bias, method=method, reduce=False)
        return self._matmul(x, method)

    def _matmul(self, x: torch.Tensor, method: str | None) -> torch.Tensor:
        if method:
            return gemv(x, self.weight, bias=self.bias, method=method)
        return F.linear(x, self.weight, self.bias)

    def normed(
        self, norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual) for an RMSNorm `norm`; without a residual,
        x itself is the residual stream."""
        if x.is_cuda and x.shape[0] == 1 and norm_prologue_pays(x.shape[1]):
            if residual is None:
                return gemv(x, self.weight, bias=self.bias, norm=(norm.weight, norm.eps)), x
            res_out = torch.empty_like(x)
            y = gemv(
                x,
                self.weight,
                bias=self.bias,
                norm=(norm.weight, norm.eps),
                residual=residual,
                residual_out=res_out,
            )
            return y, res_out
        if residual is None:
            return self(norm(x)), x
        x, residual = norm(x, residual)
        return self(x), residual

    def fuses_silu_mul(self, x: torch.Tensor) -> bool:
        """Whether `silu_mul` runs for x's rows: where this [gate; up] projection takes the dot
        or tma kernel, above two rows (`silu_mul_epilogue`)."""
        return x.is_cuda and silu_mul_epilogue(x.shape[0], *self.weight.shape)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x gate^T) * (x up^T) for this [gate; up] projection, the activation in the dot
        or tma kernel's epilogue (see `fuses_silu_mul`)."""
        return gemv(x, self.weight, bias=self.bias, silu_mul=True)  # gemv_method's dot or tma

    def gated(self, x: torch.Tensor) -> torch.Tensor | SplitSum:
        """self.unreduced(silu(gate) * up) for x = [gate | up]: a down projection, which the
        next norm (or the model's last add) reads, so a split-K product stays unsummed here too
        (65-128 rows, where gate_up runs on cuBLAS and the SiLU on its own)."""
        if self._gemv_method(x) == "stream":  # the shape's choice: W's, and x's rows
            return gemv(x, self.weight, bias=self.bias, gated=True)
        return self.unreduced(silu_and_mul(x))


class MergedLinear(Linear):
    """Projections of the same input stacked along the output dim, run as one matmul. Shard i
    (id `shard_ids[i]`, default i) is rows [sum(output_sizes[:i]), sum(output_sizes[:i+1]))."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        shard_ids: tuple[str | int, ...] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        shard_ids = shard_ids or tuple(range(len(output_sizes)))
        offsets = accumulate(output_sizes, initial=0)
        self._shards = dict(zip(shard_ids, zip(offsets, output_sizes, strict=False), strict=True))
        for param in self.parameters():
            param.shard_ids = shard_ids

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, size = self._shards[shard_id]
        # Weight (out, in) and bias (out,) both shard along dim 0.
        copy_checked(param.data.narrow(0, offset, size), loaded)


class QKVLinear(MergedLinear):
    """q, k, v projections packed as rows [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, shard_ids=("q", "k", "v"))
        self.q_size, self.kv_size = q_size, kv_size
