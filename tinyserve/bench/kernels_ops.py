"""The small-op and matmul rows of `bench.py kernels`: RMSNorm + residual, SiLU-and-mul, rotary,
the fused q/k norm + rotary + KV store, the sampler's race, the decode GEMV / skinny GEMM at 1-128
rows vs cuBLAS, and the GEMV with its prologue op fused."""

from __future__ import annotations

import torch

from tinyserve.bench.kernels import kernel_row, sweep


def bench_small_ops(res) -> None:
    import torch.nn.functional as F

    from tinyserve.kernels.gemv import gemv
    from tinyserve.kernels.rms_norm import rms_norm, rms_norm_ref
    from tinyserve.kernels.rope_store_kv import rope_store_kv
    from tinyserve.kernels.rotary import rotary_embedding
    from tinyserve.kernels.sampling import sample_race, sample_race_ref
    from tinyserve.kernels.silu_mul import silu_mul, silu_mul_ref
    from tinyserve.model.layers import attention as layer
    from tinyserve.model.layers.rotary import apply_rotary

    dev, bf16 = "cuda", torch.bfloat16

    def rnd(*shape, dtype=bf16):
        return torch.randn(*shape, device=dev, dtype=dtype)

    def both(eager):
        return {"eager": eager, "compile": torch.compile(eager, dynamic=False)}

    def norm(x, r, w, **cfg):
        return rms_norm(x, w, 1e-6, r, **cfg)

    norm_cfgs = {
        1024: [
            dict(block_m=bm, num_warps=nw)
            for bm, nw in ((1, 2), (1, 4), (2, 4), (4, 4), (4, 8), (8, 8))
        ],
        4096: [dict(block_m=1, num_warps=nw) for nw in (4, 8)],
    }
    silu_cfgs = [
        dict(block=b, num_warps=nw) for b, nw in ((512, 4), (2048, 4), (2048, 8), (4096, 8))
    ]
    for model, hidden, inter in (("qwen3-0.6b", 1024, 3072), ("llama-3.1-8b", 4096, 14336)):
        for rows in (1, 64, 8192):
            shape, nbytes = f"{model} {rows} x {hidden}", 4 * rows * hidden * 2 + hidden * 2
            norm_set = lambda h=hidden, r=rows: (rnd(r, h), rnd(r, h), rnd(h))  # noqa: E731
            kernel_row(
                res,
                "rms_norm+residual",
                shape,
                nbytes,
                0,
                norm_set,
                norm,
                both(lambda x, r, w: rms_norm_ref(x, w, 1e-6, r)),
            )
            if rows > 1 or hidden == 1024:
                sweep(res, "rms_norm+residual", shape, nbytes, norm_set, norm, norm_cfgs[hidden])
            shape, nbytes = f"{model} {rows} x {inter}", 3 * rows * inter * 2
            silu_set = lambda i=inter, r=rows: (rnd(r, 2 * i),)  # noqa: E731
            kernel_row(res, "silu_mul", shape, nbytes, 0, silu_set, silu_mul, both(silu_mul_ref))
            if rows > 1:
                sweep(res, "silu_mul", shape, nbytes, silu_set, silu_mul, silu_cfgs)
    cache = torch.randn(32768, 128, device=dev)
    for tokens in (1, 64, 8192):

        def rope_set(t=tokens):
            qkv = rnd(t, 48 * 128)
            return (
                torch.randint(0, 32768, (t,), device=dev),
                qkv[:, : 32 * 128].view(t, 32, 128),
                qkv[:, 32 * 128 : 40 * 128].view(t, 8, 128),
            )

        def rope_eager(pos, q, k):
            cos, sin = cache[pos].chunk(2, dim=-1)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        kernel_row(
            res,
            "rotary(q,k)",
            f"llama-3.1-8b T={tokens}",
            tokens * (40 * 128 * 2 * 2 + 128 * 4),
            0,
            rope_set,
            lambda p, q, k: rotary_embedding(p, q, k, cache),
            both(rope_eager),
        )
    kc, vc = rnd(4096, 16, 8, 128), rnd(4096, 16, 8, 128)  # shared: each set writes new slots
    for model, heads, norm in (("qwen3-0.6b", 16, True), ("llama-3.1-8b", 32, False)):
        for tokens in (1, 64, 8192):

            def qkv_set(t=tokens, h=heads, norm=norm):
                qkv = rnd(t, (h + 16) * 128)
                norms = (rnd(128), rnd(128)) if norm else (None, None)
                return (
                    qkv,
                    torch.randint(0, 32768, (t,), device=dev),
                    cache,
                    kc,
                    vc,
                    torch.randperm(65536, device=dev)[:t],
                    h,
                    *norms,
                )

            def qkv_eager(qkv, pos, table, kc, vc, slots, h, qn, kn):
                # The unfused ops of the torch path (every bench slot is valid: no masking sync).
                q, k, v = qkv.view(qkv.shape[0], -1, 128).split([h, 8, 8], dim=1)
                if qn is not None:
                    q, k = rms_norm_ref(q, qn, 1e-6), rms_norm_ref(k, kn, 1e-6)
                cos, sin = table[pos].chunk(2, dim=-1)
                q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
                layer.store_kv(k, v, kc, vc, slots)
                return q

            nbytes = tokens * ((heads + 16) * 128 * 2 + heads * 128 * 2 + 16 * 128 * 2 + 128 * 4)
            kernel_row(
                res,
                "rope_store_kv (q/k norm, rotary, KV store)",
                f"{model} T={tokens}",
                nbytes,
                0,
                qkv_set,
                rope_store_kv,
                both(qkv_eager),
            )
    for batch in (1, 64):
        kernel_row(
            res,
            "sample_race",
            f"B={batch} V=151936",
            batch * 151936 * 4,
            0,
            lambda b=batch: (
                rnd(b, 151936, dtype=torch.float32),
                torch.randint(-(2**62), 2**62, (b,), device=dev),
            ),
            sample_race,
            both(sample_race_ref),
        )
    shapes = {
        "qwen3-0.6b": [
            ("qkv", 4096, 1024),
            ("o", 1024, 2048),
            ("gate_up", 6144, 1024),
            ("down", 1024, 3072),
            ("lm_head", 151936, 1024),
        ],
        "llama-3.1-8b": [
            ("qkv", 6144, 4096),
            ("o", 4096, 4096),
            ("gate_up", 28672, 4096),
            ("down", 4096, 14336),
            ("lm_head", 128256, 4096),
        ],
    }
    for model, layers in shapes.items():
        for name, n, k in layers:
            # gemv_method: stream, dot up to 32 rows (64 for gate_up / LM heads of 1B+ models),
            # split-K dot for down up to 128
            more = {"down": (64, 128), "gate_up": (64,), "lm_head": (64,)}.get(name, ())
            for m in (1, 2, 4, 8, 16, 32) + more:
                shape, nbytes = f"{model} {name} M={m} {n}x{k}", (n * k + m * (n + k)) * 2
                gemv_set = lambda n=n, k=k, m=m: (rnd(m, k), rnd(n, k) * 0.05)  # noqa: E731
                kernel_row(
                    res, "gemv", shape, nbytes, 2 * m * n * k, gemv_set, gemv, {"cublas": F.linear}
                )
                if 1 < m <= 16:  # the CUDA-core kernel that wins at M = 1, for comparison
                    sweep(res, "gemv", shape, nbytes, gemv_set, gemv, [dict(method="stream")])
            if name in ("qkv", "gate_up", "down"):
                _bench_prologue(res, model, name, n, k)


def _bench_prologue(res, model: str, name: str, n: int, k: int) -> None:
    """Batch-1 decode matmul with the op before it fused (RMSNorm + residual before qkv and
    gate_up, SiLU-and-mul before down) vs the two launches it replaces and torch.compile."""
    from tinyserve.kernels.gemv import gemv, gemv_ref
    from tinyserve.kernels.rms_norm import rms_norm
    from tinyserve.kernels.silu_mul import silu_mul

    dev, bf16 = "cuda", torch.bfloat16
    if name == "down":
        nbytes = (n * k + 2 * k + n) * 2
        make_set = lambda: (  # noqa: E731
            torch.randn(1, 2 * k, device=dev, dtype=bf16),
            torch.randn(n, k, device=dev, dtype=bf16) * 0.05,
        )
        fused = lambda x, w, **cfg: gemv(x, w, gated=True, **cfg)  # noqa: E731
        ref = lambda x, w: gemv_ref(x, w, gated=True)  # noqa: E731
        two = {"silu_mul+gemv": lambda x, w: gemv(silu_mul(x), w)}
        label = "gemv(silu_mul prologue)"
    else:
        nbytes = (n * k + 4 * k + n) * 2
        make_set = lambda: (  # noqa: E731
            torch.randn(1, k, device=dev, dtype=bf16),
            torch.randn(n, k, device=dev, dtype=bf16) * 0.05,
            torch.randn(1, k, device=dev, dtype=bf16),
            torch.randn(k, device=dev, dtype=bf16),
        )

        def fused(x, w, r, nw, **cfg):
            return gemv(x, w, norm=(nw, 1e-6), residual=r, residual_out=torch.empty_like(x), **cfg)

        def ref(x, w, r, nw):
            return gemv_ref(x, w, norm=(nw, 1e-6), residual=r)

        def unfused(x, w, r, nw):
            return gemv(rms_norm(x, nw, 1e-6, r)[0], w)

        two = {"rms_norm+gemv": unfused}
        label = "gemv(rms_norm+residual prologue)"
    shape = f"{model} {name} M=1 {n}x{k}"
    torch_fns = {**two, "compile": torch.compile(ref, dynamic=False), "cublas_eager": ref}
    kernel_row(res, label, shape, nbytes, 2 * n * k, make_set, fused, torch_fns)
    sweep(res, label, shape, nbytes, make_set, fused, [dict(block_n=b) for b in (1, 2, 4, 8, 16)])
