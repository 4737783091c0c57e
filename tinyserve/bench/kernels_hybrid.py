"""The Qwen3.5 (Gated DeltaNet) rows of `bench.py kernels`: the recurrent decode update, whose
cost is reading and writing each sequence's float32 state (Hv x K x V per layer), as a fraction of
the copy rate; and the chunked delta rule over prompt chunks, as tokens/s, beside the recurrent
kernel walking the same tokens one by one; and the gated RMSNorm after it, one kernel against its
eight eager torch ops; and the fused decode step (conv + delta rule + norm in one launch) against
the three kernels it replaces, as a fraction of the copy rate over its state traffic."""

from __future__ import annotations

import torch

from tinyserve.bench.kernels import kernel_row

# (name, Hk, Hv, K, V) of the published Qwen3.5 dense sizes' DeltaNet layers
SHAPES = (("qwen3.5-0.8b", 16, 16, 128, 128), ("qwen3.5-9b", 16, 32, 128, 128))
CONV_WIDTH = 4  # linear_conv_kernel_dim of both


def _inputs(T: int, B: int, hk: int, hv: int, k: int, v: int, slots: int):
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(T, hk, k, device=dev, dtype=bf16)
    kk = torch.randn(T, hk, k, device=dev, dtype=bf16)
    vv = torch.randn(T, hv, v, device=dev, dtype=bf16)
    a = torch.randn(T, hv, device=dev, dtype=bf16)
    b = torch.randn(T, hv, device=dev, dtype=bf16)
    a_log = torch.rand(hv, device=dev).log()
    dt_bias = torch.rand(hv, device=dev)
    cu = torch.arange(0, T + 1, T // B, device=dev, dtype=torch.int32)
    state = torch.randn(slots, hv, k, v, device=dev) * 0.01
    state_slots = torch.randperm(slots, device=dev)[:B].to(torch.int32)
    has_init = torch.ones(B, dtype=torch.bool, device=dev)
    return q, kk, vv, a, b, a_log, dt_bias, cu, state, state_slots, has_init


def bench_hybrid(res) -> None:
    from tinyserve.kernels.gated_delta_decode import (
        gated_delta_decode,
        gated_delta_decode_unfused,
    )
    from tinyserve.kernels.gated_delta_rule import gated_delta_rule_chunked
    from tinyserve.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent
    from tinyserve.kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref

    for model, *dims in SHAPES:
        hk, hv, k, v = dims
        state_bytes = hv * k * v * 4
        for batch in (1, 64, 256):
            # Each sequence's state read and written once; q/k/v/a/b are negligible beside it.
            nbytes = 2 * batch * state_bytes
            kernel_row(
                res,
                "gated_delta_rule_recurrent",
                f"{model} decode {batch} seqs",
                nbytes,
                0,
                lambda b=batch, d=dims: _inputs(b, b, *d, slots=b * 2),
                gated_delta_rule_recurrent,
                {},
            )
        for batch in (1, 64, 256):
            # As the recurrent row, plus each sequence's conv window (W-1 rows of C, bf16) read
            # and written; "unfused" is conv1d + recurrent rule + gated norm, summed in one graph.
            conv_bytes = (CONV_WIDTH - 1) * (2 * hk * k + hv * v) * 2
            cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            kernel_row(
                res,
                "gated_delta_decode",
                f"{model} decode {batch} seqs",
                2 * batch * (state_bytes + conv_bytes),
                0,
                lambda b=batch, d=dims: _decode_inputs(b, *d, slots=b * 2),
                gated_delta_decode,
                {"unfused": lambda *s, cu=cu: gated_delta_decode_unfused(*s, cu_seqlens=cu)},
            )
        for tokens, seqs in ((4096, 1), (4096, 8), (16384, 32)):
            # Prefill: the state once per sequence; time is compute, reported as tokens/s.
            row_count = len(res["rows"])
            nbytes = tokens * (2 * hk * k + hv * v) * 2 * 2 + 2 * seqs * state_bytes
            make = lambda t=tokens, s=seqs, d=dims: _inputs(t, s, *d, slots=s)  # noqa: E731
            kernel_row(
                res,
                "gated_delta_rule_chunked",
                f"{model} prefill {tokens} tokens in {seqs} seqs",
                nbytes,
                0,
                make,
                gated_delta_rule_chunked,
                {"recurrent": gated_delta_rule_recurrent},
            )
            for row in res["rows"][row_count:]:
                if row.get("triton_us"):
                    row["tok_per_s"] = round(tokens / row["triton_us"] * 1e6)
                    print(f"  {row['shape']}: {row['tok_per_s']:,} tok/s", flush=True)
        for tokens in (1, 64, 4096):  # the output norm: x and gate read, the output written
            kernel_row(
                res,
                "gated_rms_norm",
                f"{model} {tokens} tokens",
                3 * tokens * hv * v * 2,
                0,
                lambda t=tokens, h=hv, n=v: _norm_inputs(t, h, n),
                gated_rms_norm,
                {"eager": gated_rms_norm_ref},
            )


def _decode_inputs(B: int, hk: int, hv: int, k: int, v: int, slots: int):
    """gated_delta_decode's arguments for B one-token rows: x, z, b, a as column slices of one
    packed projection (the layer's in_proj output), states in random slots of a pool."""
    dev, bf16 = "cuda", torch.bfloat16
    channels = 2 * hk * k + hv * v
    proj = torch.randn(B, channels + hv * v + 2 * hv, device=dev, dtype=bf16)
    x, z, b, a = proj.split([channels, hv * v, hv, hv], dim=1)
    conv_weight = torch.randn(channels, CONV_WIDTH, device=dev, dtype=bf16) * 0.5
    a_log = torch.rand(hv, device=dev).log()
    dt_bias = torch.rand(hv, device=dev)
    norm_weight = torch.ones(v, device=dev, dtype=bf16)
    conv_state = torch.randn(slots, CONV_WIDTH - 1, channels, device=dev, dtype=bf16)
    ssm_state = torch.randn(slots, hv, k, v, device=dev) * 0.01
    state_slots = torch.randperm(slots, device=dev)[:B].to(torch.int32)
    has_init = torch.ones(B, dtype=torch.bool, device=dev)
    weights = (conv_weight, a_log, dt_bias, norm_weight, 1e-6)
    return x, z.view(B, hv, v), a, b, *weights, conv_state, ssm_state, state_slots, has_init


def _norm_inputs(T: int, hv: int, v: int):
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(T, hv, v, device=dev, dtype=bf16)
    gate = torch.randn(T, hv, v, device=dev, dtype=bf16)
    return x, gate, torch.ones(v, device=dev, dtype=bf16), 1e-6
