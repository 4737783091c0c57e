"""The MTP layer's projection input in one pass (models/mtp.py):
`mtp_input(hidden (T, H), ids (T,), positions (T,), embed (V, H), hidden_weight, token_weight,
eps, hidden_first)` -> (T, 2H) = cat[norm_h(hidden), norm_t(embed[ids], zero at position 0)]
(the halves swapped unless hidden_first), each norm as rms_norm.py's (HF's cast order).

It replaces six kernels of every MTP drafting pass: the embedding gather, the position-0 mask
(a compare and a masked fill), the two norms and the cat. A zeroed embedding row normalises to
zero, so masking the gather is the same as masking its output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, next_pow2, pdl, pdl_sync
from .rms_norm import normed_rows, rms_norm_ref


@triton.jit(do_not_specialize=["num_rows"])  # any row count, one variant
def _mtp_input_kernel(
    h_ptr, ids_ptr, pos_ptr, emb_ptr, hw_ptr, tw_ptr, out_ptr, num_rows, N, eps,
    stride_h, stride_e, stride_o, h_col, t_col,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_sync(USE_PDL)  # hidden, ids and positions come from the kernels before this one
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = cols < N
    token = tl.load(ids_ptr + row).to(tl.int64)
    kept = tl.where(tl.load(pos_ptr + row) != 0, N, 0)  # columns of the embedding row read
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    e = tl.load(emb_ptr + token * stride_e + cols, mask=cols < kept, other=0.0)
    out = out_ptr + row.to(tl.int64) * stride_o
    dtype = out_ptr.dtype.element_ty
    tl.store(out + h_col + cols, normed_rows(h, hw_ptr, cols, N, eps).to(dtype), mask=mask)
    tl.store(out + t_col + cols, normed_rows(e, tw_ptr, cols, N, eps).to(dtype), mask=mask)


def mtp_input(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    hidden_weight: torch.Tensor,
    token_weight: torch.Tensor,
    eps: float,
    hidden_first: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One program a row; every tensor in hidden's dtype (ids and positions: any int)."""
    check(hidden.dim() == 2 and hidden.stride(1) == 1, "hidden must be (T, H), last dim contiguous")
    (num_rows, n), dtype, device = hidden.shape, hidden.dtype, hidden.device
    check(dtype in FLOAT_DTYPES, "unsupported dtype", dtype)
    check(ids.shape == (num_rows,) and positions.shape == (num_rows,), "ids, positions: (T,)")
    check(embed.dim() == 2 and embed.shape[1] == n and embed.stride(1) == 1, "embed: (V, H)")
    for w in (hidden_weight, token_weight):
        check(w.shape == (n,) and w.is_contiguous(), "norm weights must be (H,) contiguous")
    check(embed.dtype == hidden_weight.dtype == token_weight.dtype == dtype, "one dtype")
    check(n <= 32768, "rows longer than 32768 are not supported")
    if out is None:
        out = torch.empty(num_rows, 2 * n, dtype=dtype, device=device)
    check(out.shape == (num_rows, 2 * n) and out.dtype == dtype and out.stride(1) == 1, "bad out")
    tensors = (ids, positions, embed, hidden_weight, token_weight, out)
    check(all(t.device == device for t in tensors), "all inputs must be on one device")
    block_n = next_pow2(n)
    if num_rows:
        _mtp_input_kernel[(num_rows,)](
            hidden, ids.contiguous(), positions.contiguous(), embed, hidden_weight,
            token_weight, out, num_rows, n, eps, hidden.stride(0), embed.stride(0),
            out.stride(0), 0 if hidden_first else n, n if hidden_first else 0,
            BLOCK_N=block_n, num_warps=max(1, min(16, block_n // 256)), **pdl(device),
        )
    return out


def mtp_input_ref(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    embed: torch.Tensor,
    hidden_weight: torch.Tensor,
    token_weight: torch.Tensor,
    eps: float,
    hidden_first: bool = True,
) -> torch.Tensor:
    """The torch ops it replaces (models/mtp.py's path on the CPU)."""
    embeds = torch.nn.functional.embedding(ids, embed).masked_fill((positions == 0)[:, None], 0.0)
    parts = [rms_norm_ref(hidden, hidden_weight, eps), rms_norm_ref(embeds, token_weight, eps)]
    return torch.cat(parts if hidden_first else parts[::-1], dim=-1)
