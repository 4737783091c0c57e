"""The skinny GEMM kernels (stream, dot, tma, split-K) with their epilogues and prologues
(bias, SiLU-mul, RMSNorm, gated input, split-K sums left to the next norm), against
gemv_ref."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    BF16,
    DEVICE,
    DTYPES,
    F16,
    INTERP,
    assert_elem,
    assert_rel,
    gpu,
    needs_triton,
    poisoned,
    randn,
)

import tinyserve.kernels.gemv_config as gemv_config
from tinyserve.kernels.gemv import SplitSum, gemv, gemv_ref
from tinyserve.kernels.gemv_config import gemv_method
from tinyserve.kernels.rms_norm import rms_norm
from tinyserve.kernels.silu_mul import silu_mul_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "method"),
    [
        (1, None),
        (2, None),
        (3, None),
        (3, "stream"),
        (16, None),
        (17, None),
        (32, "dot"),
        (48, "dot"),
    ],
)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("k", [1000, 100])
def test_gemv(dtype, m, method, out_dtype, k):
    """out_dtype float32: the accumulator itself (the LM head's logits), rounded only once. Odd
    sizes: a partial row tile, and K in 8 tiles (the last partial) or in one partial tile; 17
    rows pad x to the dot kernel's 32-row tile, 32 fill it."""
    n = 37
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype or dtype, device=DEVICE)
    assert gemv(x, w, out, method=method, block_k=128) is out
    assert_rel(out, gemv_ref(x.double(), w.double()), out_dtype or dtype)


@pytest.mark.parametrize(("n", "k"), [(100, 128), (90, 100)])
@pytest.mark.parametrize("m", [2, 20])
def test_gemv_balanced_rows(m, n, k):
    """The dot kernel over runs of 20 W rows in 32-row tiles (12 masked off): every run, the last
    one short at N = 90, K in whole or partial tiles; nothing written past a run's end."""
    x, w = randn(m, k, dtype=torch.float32), randn(n, k, dtype=torch.float32)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device=DEVICE)
    assert gemv(x, w, out, method="dot", block_n=32, block_k=64, rows=20) is out
    assert_rel(out, gemv_ref(x.double(), w.double()), torch.float32)
    with pytest.raises(ValueError, match="rows must be 1..32"):
        gemv(x, w, method="dot", block_n=32, rows=33)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 20])
@pytest.mark.parametrize(("k", "rows"), [(1000, None), (100, 20), (128, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_silu_mul(dtype, m, k, rows, bias):
    """The dot kernel's gate_up epilogue: W = [gate; up] (74 x K) -> silu(gate) * up (M x 37),
    each factor rounded in dtype as the unfused projections and SiLU kernel are; programs of 16
    gate + 16 up rows in a 32-row tile, of 10 + 10 (20 rows: the rest masked off, the last run
    short), and of the whole tile (32 rows); K in partial or whole tiles."""
    n = 37
    x, w = randn(m, k, dtype=dtype), randn(2 * n, k, dtype=dtype, scale=3.0)
    b = randn(2 * n, dtype=dtype) if bias else None
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    got = gemv(x, w, out, bias=b, silu_mul=True, method="dot", block_n=32, block_k=64, rows=rows)
    assert got is out
    gate_up = gemv_ref(x.double(), w.double(), bias=None if b is None else b.double())
    assert_rel(out, silu_mul_ref(gate_up.to(dtype)).double(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 48])
@pytest.mark.parametrize(
    ("silu_mul", "bias", "out_dtype"),
    [
        (False, False, None),
        (False, True, torch.float32),
        (True, False, None),
        (True, True, None),
    ],
)
def test_gemv_tma(dtype, m, silu_mul, bias, out_dtype):
    """The tma kernel (tensor-descriptor loads): N = 37 in 16-column programs (the last one
    partial: its gate tile runs into the up rows, which must not reach y), K = 1000 in 64-wide
    steps (the last partial, zero-filled), x's rows padded to 16 / 64; with and without the
    SiLU epilogue and a bias, bf16 / fp16 / float32, float32 out (the LM head's)."""
    n, k = 37, 1000
    x = randn(m, k, dtype=dtype)
    w = randn(2 * n if silu_mul else n, k, dtype=dtype, scale=3.0 if silu_mul else 1.0)
    b = randn(w.shape[0], dtype=dtype) if bias else None
    out = poisoned(torch.empty(m, n, dtype=out_dtype or dtype, device=DEVICE))
    got = gemv(x, w, out, bias=b, silu_mul=silu_mul, method="tma", block_n=16, block_k=64)
    assert got is out
    ref = gemv_ref(x.double(), w.double(), bias=None if b is None else b.double())
    if silu_mul:
        ref = silu_mul_ref(ref.to(dtype)).double()
    assert_rel(out, ref, out_dtype or dtype)


def test_gemv_tma_rejects_unaligned_rows():
    x, w = randn(40, 100, dtype=torch.bfloat16), randn(8, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # 200-byte rows
        gemv(x, w, method="tma")


def test_gemv_silu_mul_rejects_bad_inputs():
    x, w = randn(3, 64), randn(8, 64)
    with pytest.raises(ValueError, match="dot and tma kernels' epilogue"):
        gemv(x, w, silu_mul=True, method="stream")
    with pytest.raises(ValueError, match="gate; up"):
        gemv(x, randn(7, 64), silu_mul=True, method="dot")
    with pytest.raises(ValueError, match="rows must be even"):
        gemv(x, w, silu_mul=True, method="dot", block_n=16, rows=5)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, torch.empty(3, 8, device=DEVICE), silu_mul=True, method="dot")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "method"), [(1, "stream"), (3, "dot"), (20, "dot")])
def test_gemv_bias(dtype, m, method):
    """Both kernels add a bias (Qwen2 / MiMo qkv) in float32 before the one rounding."""
    n, k = 37, 300
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    assert gemv(x, w, out, bias=bias, method=method, block_k=128) is out
    assert_rel(out, gemv_ref(x.double(), w.double(), bias=bias.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "k", "num_splits"), [(33, 1000, None), (100, 300, 3), (128, 1000, 1)]
)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_gemv_split(dtype, m, k, num_splits, out_dtype):
    """Split-K: float32 partials over whole K tiles (the last split ends in a partial tile at
    K = 300 and 1000), summed with the bias once; 33 rows pad x to 64, 100 to 128."""
    n = 37
    x, w, bias = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    out = torch.full((m, n), float("nan"), dtype=out_dtype or dtype, device=DEVICE)
    assert gemv(x, w, out, bias=bias, method="split", block_k=128, num_splits=num_splits) is out
    assert_rel(out, gemv_ref(x.double(), w.double(), bias=bias.double()), out_dtype or dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_sums_in_the_norm_equal_the_reduce_kernels(dtype, bias):
    """A split-K product left unsummed (reduce=False) and normed with a residual gives the bits
    of the reduce kernel's sum normed after it, in place too (a decoder layer's o / down
    projection and the next norm); its reduce(residual) gives the bits of that sum + residual
    (the model's last add)."""
    m, n, k = 40, 300, 1000
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    product = gemv(x, w, bias=b, method="split", block_k=128, num_splits=3, reduce=False)
    assert isinstance(product, SplitSum)
    assert product.shape == (m, n) and product.partials.shape == (3, m, n)
    summed = gemv(x, w, bias=b, method="split", block_k=128, num_splits=3)
    assert torch.equal(product.reduce(), summed)
    residual, nw = randn(m, n, dtype=dtype, scale=2.0), randn(n, dtype=dtype)
    want, want_res = rms_norm(summed, nw, 1e-6, residual)
    got, got_res = rms_norm(product, nw, 1e-6, residual)
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert torch.equal(product.reduce(residual), want_res)
    in_place = residual.clone()
    got, got_res = rms_norm(product, nw, 1e-6, in_place, residual_out=in_place)
    assert got_res is in_place and torch.equal(in_place, want_res) and torch.equal(got, want)


def test_split_k_sums_reject_bad_calls():
    x, w = randn(40, 256, dtype=BF16), randn(64, 256, dtype=BF16)
    product = gemv(x, w, method="split", reduce=False)
    with pytest.raises(ValueError, match="with a residual"):
        rms_norm(product, randn(64, dtype=BF16), 1e-6)
    with pytest.raises(ValueError, match="residual != x"):
        rms_norm(product, randn(64, dtype=BF16), 1e-6, randn(40, 64, dtype=F16))
    with pytest.raises(ValueError, match="reduce=False"):
        gemv(x, w, method="dot", reduce=False)
    with pytest.raises(ValueError, match="reduce=False"):
        gemv(x, w, torch.empty(40, 64, dtype=BF16), method="split", reduce=False)


def test_gated_down_projection_leaves_split_k_sums_to_the_next_norm(monkeypatch):
    """Where gate_up takes no SiLU epilogue (65-128 rows: cuBLAS) and the down projection runs
    split-K, `gated` hands the partials on unsummed, as `unreduced` does: the next norm sums
    them, with the reduce kernel's bits."""
    from tinyserve.model.layers.linear import Linear

    m, inter, hidden = 3, 256, 64
    down = Linear(inter, hidden).to(DEVICE, BF16)
    down.weight.data.copy_(randn(hidden, inter, dtype=BF16))
    monkeypatch.setattr(Linear, "_gemv_method", lambda self, x: "split")
    gate_up = randn(m, 2 * inter, dtype=BF16)
    product = down.gated(gate_up)
    assert isinstance(product, SplitSum)
    act = gemv_ref(gate_up, torch.eye(inter, dtype=BF16, device=DEVICE), gated=True)
    assert torch.equal(product.reduce(), gemv(act, down.weight, method="split"))
    assert_rel(product.reduce(), gemv_ref(act.double(), down.weight.double()), BF16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("k", [1000, 100])
def test_gemv_norm_prologue(dtype, m, with_residual, k):
    """gemv(norm=...) == linear(rms_norm(x + residual)); x + residual lands in residual_out,
    written by one program while the others still read x and residual."""
    n = 37
    x, w, nw = randn(m, k, dtype=dtype, scale=3.0), randn(n, k, dtype=dtype), randn(k, dtype=dtype)
    bias = randn(n, dtype=dtype)
    res = randn(m, k, dtype=dtype) if with_residual else None
    res_out = poisoned(x) if with_residual else None
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    gemv(x, w, out, bias=bias, norm=(nw, 1e-6), residual=res, residual_out=res_out, block_k=128)
    ref = gemv_ref(
        x.double(),
        w.double(),
        bias=bias.double(),
        norm=(nw.double(), 1e-6),
        residual=None if res is None else res.double(),
    )
    assert_rel(out, ref, dtype)
    if with_residual and INTERP:  # the interpreter truncates fp32 -> bf16 casts
        assert_elem(res_out, x + res, dtype)
    elif with_residual:
        assert torch.equal(res_out, x + res)  # rounded exactly as the unfused add


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block_k", [128, None])  # None: stream_config's tile
def test_gemv_gated_prologue(dtype, m, block_k):
    n, k = 37, 1000
    x, w = randn(m, 2 * k, dtype=dtype, scale=3.0), randn(n, k, dtype=dtype)
    out = poisoned(torch.empty(m, n, dtype=dtype, device=DEVICE))
    assert gemv(x, w, out, gated=True, block_k=block_k) is out
    act = gemv_ref(x, torch.eye(k, dtype=dtype, device=DEVICE), gated=True)  # silu*up in dtype
    assert_rel(out, gemv_ref(act.double(), w.double()), dtype)


@pytest.mark.parametrize("num_stages", [None, 3])
def test_gemv_stream_pipelined_loop_matches_reference(num_stages):
    """The pipelined loop (forced at 3 stages, and the rule's choice) over 16+ K tiles, one and
    two rows, plain and gated: the reference's result."""
    torch.manual_seed(0)
    w = torch.randn(24, 1024, dtype=torch.float32, device=DEVICE)
    for m, gated in ((1, False), (2, False), (2, True)):
        x = torch.randn(m, 2048 if gated else 1024, dtype=torch.float32, device=DEVICE)
        y = gemv(x, w, gated=gated, method="stream", block_n=4, block_k=64, num_stages=num_stages)
        torch.testing.assert_close(y, gemv_ref(x, w, gated=gated), rtol=1e-5, atol=1e-4)


def test_gemv_prologue_rejects_bad_inputs():
    x, w, nw = randn(1, 64), randn(8, 64), randn(64)
    with pytest.raises(ValueError, match="residual_out"):
        gemv(x, w, norm=(nw, 1e-6), residual=randn(1, 64))
    with pytest.raises(ValueError, match="alias"):
        res = randn(1, 64)
        gemv(x, w, norm=(nw, 1e-6), residual=res, residual_out=res)
    with pytest.raises(ValueError, match="gated"):
        gemv(x, w, gated=True)
    with pytest.raises(ValueError, match="norm prologue"):
        gemv(x, w, residual=randn(1, 64))
    with pytest.raises(ValueError, match="dot"):
        gemv(x, w, norm=(nw, 1e-6), method="dot")
    with pytest.raises(ValueError, match="float32"):
        gemv(x.half(), w.half(), torch.empty(1, 8, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, torch.empty(1, 9, device=DEVICE))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        (151936, 1024),
        (1024, 2048),
        (1024, 3072),
        (6144, 4096),
        (4096, 4096),
        (22016, 4096),
        (4096, 14336),
    ],
)
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 17, 32])
def test_gemv_gpu(shape, m):
    """Real shapes, each row count's tuned method and tile (pipelined stream loops included:
    gate_up at one row, every two-row W at K >= 4096)."""
    n, k = shape
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    ref = gemv_ref(x.float(), w.float())
    for method in (None, "stream") if 1 < m <= 16 else (None,):
        out = torch.full((m, n), float("nan"), dtype=BF16, device=DEVICE)
        gemv(x, w, out, method=method)
        assert_rel(out, ref, BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_gated_gpu(m):
    """MiMo-7B's down projection with the gated prologue (22 pipelined tiles at two rows)."""
    x, w = randn(m, 2 * 11008, dtype=BF16), randn(4096, 11008, dtype=BF16) * 0.05
    out = torch.full((m, 4096), float("nan"), dtype=BF16, device=DEVICE)
    gemv(x, w, out, gated=True)
    assert_rel(out, gemv_ref(x.float(), w.float(), gated=True), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(22016, 4096), (28672, 4096), (6144, 1024)])
@pytest.mark.parametrize("m", [3, 4, 16, 32, 64])
def test_gemv_silu_mul_gpu(shape, m):
    """gate_up with the SiLU epilogue at MiMo-7B / Llama-3.1-8B / Qwen3-0.6B shapes, in each row
    count's dot tiles (balanced runs of 84 gate + 84 up rows for MiMo to 32 rows)."""
    n, k = shape
    if not gemv_config.silu_mul_epilogue(m, n, k):
        pytest.skip("not the dot kernel here")
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    out = gemv(x, w, silu_mul=True, method="dot")
    assert_rel(out, silu_mul_ref(gemv_ref(x.float(), w.float()).to(BF16)).float(), BF16)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "m", "method"),
    [
        (s, m, "split")
        for s in [(1024, 3072), (2048, 8192), (4096, 11008), (4096, 14336)]
        for m in (33, 64, 100, 128)
    ]
    + [
        (s, m, "dot")
        for s in [(151936, 1024), (28672, 4096), (22016, 4096), (16384, 2048)]
        for m in (33, 64)
    ]
    + [((4096, 4096), m, "split") for m in (33, 48, 64, 96, 128)]
    + [((6144, 4096), 64, "dot")],
)
def test_gemv_many_rows_gpu(shape, m, method):
    """Above 32 rows: down projections (to 128 rows) take split-K, wide W (LM heads, gate_up; to
    64 rows) the dot kernel, or on Hopper the tma kernel where `_tma_pays` (MiMo-7B's gate_up);
    a 7-8B model's attention out split-K (to 128 rows) and its qkv the dot kernel above 48 rows."""
    n, k = shape
    x, w = randn(m, k, dtype=BF16), randn(n, k, dtype=BF16) * 0.05
    out = torch.full((m, n), float("nan"), dtype=BF16, device=DEVICE)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert gemv_method(m, n, k) == ("tma" if hopper and (n, k) == (22016, 4096) else method)
    gemv(x, w, out)
    assert_rel(out, gemv_ref(x.float(), w.float()), BF16)
