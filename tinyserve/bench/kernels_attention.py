"""The attention rows of `bench.py kernels`: paged decode attention (plain, split-K sweeps, shared
prefixes as the cascade path reads them) and paged prefill attention (fresh prompts, chunks after
a cached prefix, a mixed decode + prefill batch), on randomly placed KV blocks."""

from __future__ import annotations

import numpy as np
import torch

from tinyserve.bench.kernels import kernel_row, sweep


def paged_inputs(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size):
    """bf16 q (T, Hq, D), caches with shuffled blocks, and the matching AttentionMetadata."""
    from tinyserve.model.layers.attention import AttentionMetadata

    dev, bf16 = "cuda", torch.bfloat16
    per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, device=dev, dtype=bf16) for _ in range(2))
    ids = torch.randperm(num_blocks - 1, device=dev).int() + 1
    table = torch.zeros(len(context_lens), max(per_seq), dtype=torch.int32, device=dev)
    for b, off in enumerate(torch.tensor([0, *per_seq]).cumsum(0)[:-1].tolist()):
        table[b, : per_seq[b]] = ids[off : off + per_seq[b]]
    cu = torch.tensor([0, *query_lens], device=dev).cumsum(0).int()
    lens = torch.tensor(context_lens, dtype=torch.int32, device=dev)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=dev),
        block_tables=table,
        cu_seqlens_q=cu,
        context_lens=lens,
        query_lens_cpu=list(query_lens),
        context_lens_cpu=list(context_lens),
        max_context_len=max(context_lens),
        is_decode_only=all(n == 1 for n in query_lens),
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=dev, dtype=bf16)
    return q, k_cache, v_cache, md


def bench_attention(res) -> None:
    import torch.nn.functional as F

    from tinyserve.kernels.decode_attention import decode_attention
    from tinyserve.kernels.prefill_attention import prefill_attention
    from tinyserve.model.layers import attention as layer

    scale = 128**-0.5
    decode_sweeps = {  # (batch, ctx) of llama-3.1-8b -> configs compared with the default
        (64, 4096): [dict(num_splits=s, num_stages=st) for s in (1, 2) for st in (3, 4)],
        (1, 4096): [dict(num_splits=s) for s in (16, 32, 64)],
        (8, 16384): [dict(num_splits=s) for s in (4, 8, 16)],
    }
    for model, hq, batch, ctx in (
        ("llama-3.1-8b", 32, 64, 4096),
        ("llama-3.1-8b", 32, 1, 4096),
        ("llama-3.1-8b", 32, 8, 16384),
        ("qwen3-0.6b", 16, 64, 4096),
    ):
        nbytes = 2 * batch * ctx * 8 * 128 * 2 + 2 * batch * hq * 128 * 2  # KV + q + out

        def make_set(batch=batch, ctx=ctx, hq=hq):  # fresh caches: no L2 reuse across sets
            q, k, v, md = paged_inputs([1] * batch, [ctx] * batch, hq, 8, 128, 16)
            gather = md.block_tables.long()  # contiguous (B, Hkv, L, D) copies for SDPA
            kc, vc = (x[gather].flatten(1, 2).transpose(1, 2).contiguous() for x in (k, v))
            return q.view(batch, hq, 128), k, v, md, kc, vc

        def tri(q, k, v, md, kc, vc, **cfg):
            return decode_attention(
                q,
                k,
                v,
                md.block_tables,
                md.context_lens,
                scale,
                max_context_len=md.max_context_len,
                **cfg,
            )

        def eager(q, k, v, md, kc, vc):
            return layer.decode_attention_ref(q, k, v, md, scale)

        def sdpa(q, k, v, md, kc, vc):  # contiguous KV, not paged: a bound for torch
            return F.scaled_dot_product_attention(
                q[:, :, None], kc, vc, scale=scale, enable_gqa=True
            )

        torch_fns = {"eager": eager, "sdpa_contiguous": sdpa}
        if batch == 64:
            torch_fns["compile"] = torch.compile(eager, dynamic=False)
        shape = f"{model} B={batch} ctx={ctx} bs=16"
        kernel_row(res, "decode_attention", shape, nbytes, 0, make_set, tri, torch_fns)
        if model == "llama-3.1-8b":
            sweep(res, "decode_attention", shape, nbytes, make_set, tri, decode_sweeps[batch, ctx])
    # Shared prefixes (the prefix benchmark's decode steps): 512 rows in 16 groups sharing a
    # 2,048-token prompt + 320 tokens each; GB/s counts the KV stored once (what cascade reads).
    from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows
    from tinyserve.runner.graphs import plan_shared_prefixes

    def make_shared():
        q, k, v, md = paged_inputs([1] * 512, [2368] * 512, 16, 8, 128, 16)
        md.block_tables[:, :128] = md.block_tables[torch.arange(512) % 16, :128]
        plan = plan_shared_prefixes(
            md.block_tables.cpu().numpy(), np.full(512, 2368), 16, shared_prefix_rows(16, 8), 256
        )
        return q.view(512, 16, 128), k, v, md, *(torch.from_numpy(x).cuda() for x in plan)

    def plain(q, k, v, md, chunks, lens):
        return decode_attention(q, k, v, md.block_tables, md.context_lens, scale)

    def cascade(q, k, v, md, chunks, lens):
        return decode_attention(
            q, k, v, md.block_tables, md.context_lens, scale, shared_chunks=chunks, shared_lens=lens
        )

    nbytes = (16 * 2048 + 512 * 320) * 8 * 128 * 2 * 2
    shape = "qwen3-0.6b B=512 16 groups x 2048 shared + 320 ctx"
    kernel_row(
        res,
        "decode_attention[shared prefix]",
        shape,
        nbytes,
        0,
        make_shared,
        cascade,
        {"plain_triton": plain},
    )
    # Prefill: fresh prompts, chunks after a cached prefix, and a mixed decode + prefill batch.
    prefill_cfgs = [
        dict(block_m=128, block_n=128, num_warps=8),
        dict(block_m=128, block_n=64, num_warps=4),
        dict(block_m=64, block_n=64, num_warps=4),
        dict(block_m=64, block_n=128, num_warps=4),
        dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
        dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    ]
    for label, query_lens, lens in (
        ("4 x 2048 fresh", [2048] * 4, [2048] * 4),
        ("8 x 512 after 1536 cached", [512] * 8, [2048] * 8),
        ("32 decode ctx 2048 + 2 x 1024 chunks", [1] * 32 + [1024] * 2, [2048] * 32 + [1024, 3072]),
    ):
        visible = sum(sum(range(n - ql + 1, n + 1)) for ql, n in zip(query_lens, lens))
        nbytes = 2 * sum(lens) * 8 * 128 * 2 + 2 * sum(query_lens) * 32 * 128 * 2

        def tri(q, k, v, md, **cfg):
            return prefill_attention(
                q,
                k,
                v,
                md.block_tables,
                md.cu_seqlens_q,
                md.context_lens,
                max(md.query_lens_cpu),
                scale,
                **cfg,
            )

        def eager(q, k, v, md):
            return layer.prefill_attention_ref(q, k, v, md, scale)

        def make_set(ql=query_lens, n=lens):
            return paged_inputs(ql, n, 32, 8, 128, 16)

        shape = f"llama-3.1-8b {label}"
        flops = 4 * 32 * 128 * visible
        kernel_row(res, "prefill_attention", shape, nbytes, flops, make_set, tri, {"eager": eager})
        for cfg in prefill_cfgs:
            kernel_row(
                res,
                "prefill_attention[sweep]",
                shape,
                nbytes,
                flops,
                make_set,
                lambda *s, cfg=cfg: tri(*s, **cfg),
                {},
                cfg=cfg,
            )
