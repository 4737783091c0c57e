"""Shared by the test_kernels_*.py modules: inputs, tolerances and markers for checking each
Triton kernel against its pure-torch reference on random inputs, output poisoned first.

On CPU the kernels run under TRITON_INTERPRET=1 at small shapes (bf16 casts there truncate and
bf16 dots are upcast, so bf16 tolerances allow an ulp); with CUDA the same tests run on the GPU,
and the `gpu`-marked ones add real model shapes (`make test-gpu`). Import this module before
any `tinyserve.kernels` module (isort puts it first): it picks the interpreter on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # before the kernels import triton.jit
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinyserve.kernels._common import is_interpreter  # noqa: E402

INTERP = is_interpreter()
DEVICE = "cpu" if INTERP else "cuda"
needs_triton = pytest.mark.skipif(not (INTERP or HAS_CUDA), reason="needs CUDA or the interpreter")
gpu = pytest.mark.skipif(not HAS_CUDA or INTERP, reason="needs CUDA (interpreter off)")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = [F32, BF16, F16]
# Relative L2 error bounds for whole-op outputs, and (rtol, atol) for elementwise ops.
REL = {F32: 1e-5, BF16: 1.6e-2, F16: 2e-3}
ELEM = {F32: (1e-5, 1e-5), BF16: (1.6e-2, 1e-2), F16: (2e-3, 1e-3)}


def randn(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def assert_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < REL[dtype], f"relative error {err:.2e} >= {REL[dtype]:.0e}"


def assert_elem(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    rtol, atol = ELEM[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


def paged_cache(batch, context_lens, num_kv_heads, head_dim, block_size, dtype):
    """Random caches with blocks scattered in a shuffled pool; block 0 (the table padding), the
    unused blocks and the slots past each context hold NaN, so any invalid read shows."""
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    ids = torch.randperm(num_blocks - 1, device=DEVICE).int() + 1
    table = torch.zeros(batch, max(per_seq), dtype=torch.int32, device=DEVICE)
    start = 0
    for b, (n, nb) in enumerate(zip(context_lens, per_seq, strict=True)):
        blocks = ids[start : start + nb]
        start += nb
        table[b, :nb] = blocks
        valid[blocks] = True
        valid[blocks[-1], n - (nb - 1) * block_size :] = False  # the tail of the last block
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, table, lens
