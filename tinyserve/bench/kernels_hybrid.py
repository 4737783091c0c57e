"""The Qwen3.5 (Gated DeltaNet) rows of `bench.py kernels`: the recurrent decode update, whose
cost is reading and writing each sequence's float32 state (Hv x K x V per layer), as a fraction of
the copy rate; and the chunked delta rule over prompt chunks, as tokens/s, beside the recurrent
kernel walking the same tokens one by one; and the gated RMSNorm after it, one kernel against its
eight eager torch ops."""

from __future__ import annotations

import torch

from tinyserve.bench.kernels import kernel_row

# (name, Hk, Hv, K, V) of the published Qwen3.5 dense sizes' DeltaNet layers
SHAPES = (("qwen3.5-0.8b", 16, 16, 128, 128), ("qwen3.5-9b", 16, 32, 128, 128))


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


def _norm_inputs(T: int, hv: int, v: int):
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(T, hv, v, device=dev, dtype=bf16)
    gate = torch.randn(T, hv, v, device=dev, dtype=bf16)
    return x, gate, torch.ones(v, device=dev, dtype=bf16), 1e-6
