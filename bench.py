"""tinyserve benchmarks: `python bench.py WORKLOAD [options]`, a table on stdout and JSON on disk.

Workloads:
  cpu   SmolLM2-135M (or --model) greedy decode at batch 1 and batch 32 next to transformers
        `generate` on the same prompts, with this machine's measured copy and GEMM ceilings.
  kernels  (CUDA) each Triton kernel in kernels/ vs its torch version (eager, torch.compile)
        at real shapes, timed as CUDA-graph replays, as GB/s and a fraction of the copy rate.
  e2e   (CUDA) the engine on model shapes with dummy weights (--model qwen3-0.6b ...): latency
        (batch 1), nano-vllm, decode-heavy, prefill-heavy, batch 64 vs transformers (--workloads).
  prefix  prefix caching on vs off (shared prefix, no sharing; --repeats fresh sets) and the
        long-context interleaving run (--long-budget; 0 skips it: streams decode, a long prompt
        arrives, then decodes beside them). --small: the CPU sizes.
  spec  speculative decoding: n-gram on edit prompts (CPU), or MTP on --model mimo-7b with
        acceptance forced to 0..k (GPU).
  pool  the block pool's host cost per KV block, prefix caching on vs off, and the objects the
        cyclic GC tracks with the cache full.
  serve  an online client against a running `tinyserve run` (--url): request-rate and
        concurrency sweeps over random or fixed lengths; TTFT, TPOT, ITL (median, p99) and
        throughput as vLLM defines them, and /health latency probed during the run.
Every figure is measured in this run; ratios compare numbers from this same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

# `python bench.py` puts this checkout first on sys.path, where its kernels/ directory would
# shadow the PyPI `kernels` package that transformers (>= 5.25) imports. tinyserve is installed
# (`make install`), so the checkout goes last, where an uninstalled tinyserve is still found.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [_HERE]


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def measure_ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and GEMM rate in fp32 and bf16 on this device."""
    n = 1 << 30  # bytes: far larger than any cache
    a = torch.randn(n // 4, device=device)
    b = torch.empty_like(a)
    best = min(_timed(lambda: b.copy_(a), device) for _ in range(5))
    res = {"copy_GBps": 2 * n / best / 1e9}
    size = 1024 if device == "cpu" else 8192
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(size, size, device=device, dtype=dt)
        t = min(_timed(lambda x=x: x @ x, device) for _ in range(3))
        res[f"gemm_{str(dt)[6:]}_GFLOPs"] = 2 * size**3 / t / 1e9
    return res


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def make_prompts(tokenizer, num: int) -> list[list[int]]:
    topics = [
        "the ocean",
        "a city at night",
        "mathematics",
        "an old library",
        "mountains",
        "a robot",
        "bread baking",
        "the stars",
    ]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Write a long story about {topics[i % 8]} ({i})."}]
            ),
            add_special_tokens=False,
        )
        for i in range(num)
    ]


def run_tinyserve(llm, prompts, new_tokens: int) -> float:
    from tinyserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / dt


def run_hf(model_path: str, prompts, new_tokens: int, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    width = max(len(p) for p in prompts)
    pad = model.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(
        do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=pad
    )
    with torch.inference_mode():
        model.generate(
            ids[:1, -8:],
            attention_mask=mask[:1, -8:],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


def bench_cpu(args) -> dict:
    from tinyserve import LLM
    from tinyserve.model.gguf import default_model_path

    path = args.model or default_model_path()
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"ceilings": measure_ceilings("cpu"), "rows": []}
    llm_by_dtype = {}
    for dtype in args.dtypes:
        llm_by_dtype[dtype] = LLM(path, dtype=dtype, device="cpu", seed=0)
    prompts_all = make_prompts(llm_by_dtype[args.dtypes[0]].tokenizer, max(args.batches))
    for batch in args.batches:
        prompts = prompts_all[:batch]
        row = {"batch": batch, "new_tokens": args.new_tokens}
        for dtype, llm in llm_by_dtype.items():
            row[f"tinyserve_{dtype}"] = run_tinyserve(llm, prompts, args.new_tokens)
        if args.compare_hf:
            row["transformers_float32"] = run_hf(path, prompts, args.new_tokens, torch.float32)
            for dtype in args.dtypes:
                hf = row["transformers_float32"]
                row[f"ratio_{dtype}_vs_hf"] = row[f"tinyserve_{dtype}"] / hf
        res["rows"].append(row)
    return res


def _graph_us(fn, sets, reps: int = 25) -> float:
    """Median microseconds per fn(*s) call: one CUDA graph runs fn over every input set (no
    launch gaps; the sets rotate so weights and KV stream from HBM, not L2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, autotunes, allocates outside capture
        for _ in range(2):
            for s in sets:
                fn(*s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in sets:
            fn(*s)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2] * 1e3 / len(sets)


def _kernel_row(res, name, shape, nbytes, flops, make_set, triton_fn, torch_fns, **extra):
    """Times triton_fn and each torch version on the same input sets; appends one row."""
    if res.get("only") and not any(word in name for word in res["only"]):
        return
    sets = [make_set() for _ in range(max(1, min(64, -(-(256 << 20) // nbytes))))]
    row = {"kernel": name, "shape": shape, **extra}
    for label, fn in [("triton", triton_fn), *torch_fns.items()]:
        try:
            row[f"{label}_us"] = round(_graph_us(fn, sets), 2)
        except Exception as e:  # noqa: BLE001 - a failing variant must not end the run
            row[f"{label}_us"], row[f"{label}_error"] = None, f"{type(e).__name__}: {e}"[:200]
    t = row["triton_us"]
    if t:
        row["GBps"] = round(nbytes / t / 1e3, 1)
        row["frac_copy"] = round(nbytes / t / 1e3 / res["ceilings"]["copy_GBps"], 3)
        if flops:
            row["TFLOPs"] = round(flops / t / 1e6, 1)
        torch_us = [row[f"{k}_us"] for k in torch_fns if row.get(f"{k}_us")]
        if torch_us:
            row["speedup_vs_best_torch"] = round(min(torch_us) / t, 2)
    res["rows"].append(row)
    keys = ("kernel", "shape", "cfg", "GBps", "frac_copy", "TFLOPs", "speedup_vs_best_torch")
    shown = [k for k in row if k in keys or k.endswith("_us")]
    print("  ".join(f"{k}={row[k]}" for k in shown), flush=True)


def _paged_inputs(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size):
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


def _sweep(res, name, shape, nbytes, make_set, fn, cfgs) -> None:
    """One row per launcher config (keyword arguments), timed like the default."""
    for cfg in cfgs:
        _kernel_row(
            res,
            f"{name}[sweep]",
            shape,
            nbytes,
            0,
            make_set,
            lambda *s, cfg=cfg: fn(*s, **cfg),
            {},
            cfg=cfg,
        )


def _bench_attention(res) -> None:
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
            q, k, v, md = _paged_inputs([1] * batch, [ctx] * batch, hq, 8, 128, 16)
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
        _kernel_row(res, "decode_attention", shape, nbytes, 0, make_set, tri, torch_fns)
        if model == "llama-3.1-8b":
            _sweep(res, "decode_attention", shape, nbytes, make_set, tri, decode_sweeps[batch, ctx])
    # Shared prefixes (the prefix benchmark's decode steps): 512 rows in 16 groups sharing a
    # 2,048-token prompt + 320 tokens each; GB/s counts the KV stored once (what cascade reads).
    from tinyserve.kernels.shared_prefix_attention import shared_prefix_rows
    from tinyserve.runner.graphs import plan_shared_prefixes

    def make_shared():
        q, k, v, md = _paged_inputs([1] * 512, [2368] * 512, 16, 8, 128, 16)
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
    _kernel_row(
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
            return _paged_inputs(ql, n, 32, 8, 128, 16)

        shape = f"llama-3.1-8b {label}"
        flops = 4 * 32 * 128 * visible
        _kernel_row(res, "prefill_attention", shape, nbytes, flops, make_set, tri, {"eager": eager})
        for cfg in prefill_cfgs:
            _kernel_row(
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


def _bench_small_ops(res) -> None:
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
            _kernel_row(
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
                _sweep(res, "rms_norm+residual", shape, nbytes, norm_set, norm, norm_cfgs[hidden])
            shape, nbytes = f"{model} {rows} x {inter}", 3 * rows * inter * 2
            silu_set = lambda i=inter, r=rows: (rnd(r, 2 * i),)  # noqa: E731
            _kernel_row(res, "silu_mul", shape, nbytes, 0, silu_set, silu_mul, both(silu_mul_ref))
            if rows > 1:
                _sweep(res, "silu_mul", shape, nbytes, silu_set, silu_mul, silu_cfgs)
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

        _kernel_row(
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
            _kernel_row(
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
        _kernel_row(
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
                _kernel_row(
                    res, "gemv", shape, nbytes, 2 * m * n * k, gemv_set, gemv, {"cublas": F.linear}
                )
                if 1 < m <= 16:  # the CUDA-core kernel that wins at M = 1, for comparison
                    _sweep(res, "gemv", shape, nbytes, gemv_set, gemv, [dict(method="stream")])
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
    _kernel_row(res, label, shape, nbytes, 2 * n * k, make_set, fused, torch_fns)
    _sweep(res, label, shape, nbytes, make_set, fused, [dict(block_n=b) for b in (1, 2, 4, 8, 16)])


def bench_kernels(args) -> dict:
    """Each Triton kernel vs its torch version (eager, torch.compile where it applies) at real
    shapes, bf16, timed as CUDA-graph replays; GB/s and the fraction of the measured copy rate."""
    assert torch.cuda.is_available(), "the kernels workload needs a CUDA device"
    torch.manual_seed(0)
    res = {
        "device": torch.cuda.get_device_name(),
        "ceilings": measure_ceilings("cuda"),
        "rows": [],
        "only": args.only,
    }
    print(json.dumps(res["ceilings"]), flush=True)
    _bench_attention(res)
    _bench_small_ops(res)
    return res


# -- prefix caching and long-context interleaving (issue: prefix trie / chunked prefill) -------

SHAPES = {  # published HF configs of the benchmark models, for dummy weights in real shapes
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=5e5,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=5e5,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
    # XiaomiMiMo/MiMo-7B-RL: a Qwen2 body with one MTP layer
    "mimo-7b": dict(
        architectures=["MiMoForCausalLM"],
        model_type="mimo",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=151680,
        tie_word_embeddings=False,
        rope_theta=640000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=1,
        attention_bias=True,
        torch_dtype="bfloat16",
    ),
}


def resolve_model(name: str | None) -> tuple[str, str]:
    """(directory, load_format): a named shape becomes a config-only directory with dummy
    weights and no tokenizer (prompts are token ids); anything else is an HF directory."""
    if name in SHAPES:
        import tempfile

        path = tempfile.mkdtemp(prefix=f"tinyserve-{name}-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(SHAPES[name], f)
        return path, "dummy"
    from tinyserve.model.gguf import default_model_path

    return name or default_model_path(), "auto"


def drive(engine, arrivals: list[tuple[float, str, list[int], object]]) -> dict:
    """Step the engine over requests arriving at given offsets (seconds); per request: arrival,
    first-token time and every token's time (for TTFT and inter-token latency)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    stats: dict[str, dict] = {}
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            _, rid, ids, params = pending.pop(0)
            engine.add_request(rid, ids, params)
            stats[rid] = {"arrival": now, "times": []}
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for d in engine.step():
            t = time.perf_counter() - t0
            stats[d.request_id]["times"] += [t] * sum(len(o.token_ids) for o in d.outputs)
    stats["_elapsed"] = time.perf_counter() - t0
    return stats


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def _as_served(engine) -> None:
    """The server's start-up GC setup (cli.py): objects built so far leave the collector's
    generations, so full collections stop rescanning them (~100 ms each on the H100 host at 512
    sequences, ~6 per shared-prefix set). `_free_gpu` undoes it."""
    import gc

    gc.collect()
    gc.freeze()


def _free_gpu() -> None:
    """Return the memory of engines the caller dropped (weights, KV pool, graph pools)."""
    import gc

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_prefix(args) -> dict:
    """Shared-prefix groups with the cache on vs off, random prompts on vs off, and a long
    prompt arriving while streams decode (ITL p99 during its prefill, its TTFT vs alone).

    All requests arrive at once. `--max-num-seqs` (default 512, every request) keeps the
    sequence cap from binding, so concurrency is limited by KV capacity as in vLLM V1 on an
    80 GB card (its LLM default is 1024): with a cap of 256 the median of 512 TTFTs is the first
    request of the second wave, i.e. the decode time of the first wave, whatever the cache."""
    import random

    from tinyserve import LLM, SamplingParams

    path, load_format = resolve_model(args.model)
    g, r, sys_len, q_len, out_len = 16, 32, 2048, 256, 128
    n_streams, long_len = 64, 32768
    if args.small:  # the CPU sizes: the groups and requests a group above, lengths / 4
        sys_len, q_len, out_len = 512, 64, 32
        n_streams, long_len = 8, 4096
    long_len = args.long_len or long_len
    rng = random.Random(0)
    res = {"rows": []}
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    vocab = 49152 if args.model not in SHAPES else SHAPES[args.model]["vocab_size"]

    def rand_ids(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def workloads(k: int) -> dict:
        systems = [rand_ids(sys_len) for _ in range(g)]
        shared = [
            (0.0, f"{k}g{i}r{j}", systems[i] + rand_ids(q_len), params)
            for j in range(r)
            for i in range(g)
        ]
        unique = [(0.0, f"{k}u{i}", rand_ids(sys_len + q_len), params) for i in range(g * r)]
        return {"shared_prefix": shared, "no_sharing": unique}

    # --repeats R: R fresh sets of each workload (new system prompts: no hit on an earlier set),
    # run in the same order on both engines; the row reports the median over the sets (0: the
    # long-context run only).
    sets = [workloads(k) for k in range(args.repeats)]
    rows = {
        name: {
            "workload": name,
            "requests": g * r,
            "prompt_len": sys_len + q_len,
            "output_len": out_len,
            "max_num_seqs": args.max_num_seqs,
            "repeats": args.repeats,
        }
        for name in ("shared_prefix", "no_sharing")
        if sets
    }
    for on in (True, False) if sets else ():
        llm = LLM(
            path,
            load_format=load_format,
            enable_prefix_caching=on,
            seed=0,
            max_num_seqs=args.max_num_seqs,
        )
        engine, tag = llm.engine, "on" if on else "off"
        # Warm-up: Triton compiles each kernel variant on first use (seconds on a fresh machine,
        # whose compile cache is empty); a shared head also compiles the cached-prefix paths.
        head = rand_ids(sys_len)
        warm = SamplingParams(temperature=0, max_tokens=4)
        drive(engine, [(0.0, f"warm{i}{tag}", head + rand_ids(q_len), warm) for i in range(3)])
        _as_served(engine)
        res["device"], res["kv_capacity_tokens"] = engine.config.device, engine.kv_capacity_tokens
        for name, reqs in ((name, w[name]) for w in sets for name in w):
            row, trie = rows[name], engine.pool.trie
            q0, h0 = (trie.num_query_tokens, trie.num_hit_tokens) if trie else (0, 0)
            st = drive(engine, [(0.0, rid + tag, ids, p) for _, rid, ids, p in reqs])
            elapsed = st.pop("_elapsed")
            ttft = _pct([s["times"][0] - s["arrival"] for s in st.values()], 0.5)
            row.setdefault(f"ttft_median_s_{tag}_sets", []).append(ttft)
            row.setdefault(f"tok_per_s_{tag}_sets", []).append(len(reqs) * out_len / elapsed)
            if trie:
                rate = (trie.num_hit_tokens - h0) / (trie.num_query_tokens - q0)
                row.setdefault("hit_rate_sets", []).append(rate)
                bs = engine.pool.block_size
                theory = (r - 1) * (sys_len // bs * bs) / (r * (sys_len + q_len))
                row["hit_rate_theory"] = theory if name == "shared_prefix" else 0.0
            engine.check_invariants()
        llm = engine = None
        _free_gpu()
    for row in rows.values():
        for key in [k for k in row if k.endswith("_sets")]:
            row[key[: -len("_sets")]] = _pct(row[key], 0.5)
        row["ttft_speedup"] = row["ttft_median_s_off"] / row["ttft_median_s_on"]
        row["throughput_ratio"] = row["tok_per_s_on"] / row["tok_per_s_off"]
        res["rows"].append(row)
        print(row, flush=True)
    if args.long_budget:  # 0: skip the long-context run
        res["rows"].append(
            _long_context(
                path,
                load_format,
                args.long_budget,
                n_streams,
                long_len,
                rand_ids,
                args.lane_tokens,
                args.lane_reserve_sms,
            )
        )
        print(res["rows"][-1], flush=True)
    return res


def bench_pool(args) -> dict:
    """Host cost of the block pool per KV block, prefix cache on vs off, for prompts that share
    nothing (the no-sharing workload's bookkeeping): 256 prompts of 1,024 tokens, each matched,
    allocated (evicting cached blocks once the pool is full), committed and freed."""
    import gc
    import random

    from tinyserve.core.block_pool import BlockPool
    from tinyserve.core.sequence import Sequence
    from tinyserve.sampling_params import SamplingParams

    rng, res = random.Random(0), {"rows": []}
    for cache in (True, False):
        pool, times = BlockPool(20000, 16, enable_prefix_caching=cache), []
        for _ in range(6):
            seqs = [
                Sequence(i, str(i), 0, ids, len(ids), SamplingParams(), 0, 16, 1 << 20)
                for i in range(256)
                for ids in [[rng.randrange(2000) for _ in range(1024)]]
            ]
            t = time.perf_counter()
            for seq in seqs:
                pool.match_prefix(seq)
                pool.may_append(seq, seq.num_tokens)
                seq.num_kv_computed = seq.num_tokens
                pool.commit(seq)
            for seq in seqs:
                pool.free_seq(seq)
            times.append(time.perf_counter() - t)
        us = min(times[1:]) / (256 * 64) * 1e6  # the first pass fills the pool, then it evicts
        # Objects the cyclic GC walks on every full collection, with 20k blocks cached (two
        # passes: a tuple is untracked once the tuples inside it are).
        gc.collect()
        gc.collect()
        res["rows"].append(
            {
                "prefix_caching": cache,
                "us_per_block": round(us, 3),
                "gc_tracked_objects": len(gc.get_objects()),
            }
        )
        print(res["rows"][-1], flush=True)
        pool = seqs = None
    # Prefix hits: 256 prompts on one cached 2,048-token head (the shared-prefix workload's
    # admissions), each matched and released; per matched block.
    pool = BlockPool(20000, 16, enable_prefix_caching=True)
    head = [rng.randrange(2000) for _ in range(2048)]
    seqs = [
        Sequence(i, str(i), 0, ids, len(ids), SamplingParams(), 0, 16, 1 << 20)
        for i in range(257)
        for ids in [head + [rng.randrange(2000) for _ in range(256)]]
    ]
    pool.may_append(seqs[0], seqs[0].num_tokens)
    seqs[0].num_kv_computed = seqs[0].num_tokens
    pool.commit(seqs[0])
    times = []
    for _ in range(6):
        t = time.perf_counter()
        for seq in seqs[1:]:
            assert pool.match_prefix(seq) == 2048  # the whole head
        times.append(time.perf_counter() - t)
        for seq in seqs[1:]:
            pool.free_seq(seq)
            seq.num_kv_computed = 0
    us = min(times) / (256 * 128) * 1e6
    res["rows"].append({"prefix_hit_us_per_matched_block": round(us, 3)})
    print(res["rows"][-1], flush=True)
    return res


LONG_ROW_TOKENS = 32  # the long prompt's tokens after its first, decoded beside the streams


def _long_context(
    path,
    load_format,
    budget,
    n_streams,
    long_len,
    rand_ids,
    lane_tokens=None,
    lane_reserve_sms=None,
) -> dict:
    """Streams decode; a long prompt arrives: ITL p99 while it is computed (beside them on the
    prefill lane where there is one, else chunked into their steps) vs the median without it,
    and its TTFT vs the same prompt on the idle engine; then the ITL median while it decodes
    LONG_ROW_TOKENS tokens beside them (one long row among short ones).

    "Without it" is a control run: fresh streams of the same lengths, stepped as many times
    with no long prompt, medians taken over the same step ranges. The streams' own contexts
    grow meanwhile (64 -> ~550 tokens while qwen3-0.6b's 32k prompt runs: its decode step reads
    ~4x the KV by the end), so the steps before the prompt arrived understate a step without
    it; their median is kept as `itl_median_ms_before`."""
    from tinyserve import LLM, SamplingParams

    llm = LLM(
        path,
        load_format=load_format,
        max_num_batched_tokens=budget,
        seed=0,
        prefill_lane_tokens=lane_tokens,
        prefill_lane_reserve_sms=lane_reserve_sms,
    )
    engine = llm.engine
    lane = engine.runner.lane
    long_len = min(long_len, engine.max_model_len - 64)
    one = SamplingParams(temperature=0, max_tokens=1)
    drive(engine, [(0.0, "warm", rand_ids(min(long_len, 4 * budget)), one)])  # compile, warm
    _as_served(engine)
    alone = drive(engine, [(0.0, "alone", rand_ids(long_len), one)])
    ttft_alone = alone["alone"]["times"][0] - alone["alone"]["arrival"]
    endless = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for i in range(n_streams):
        engine.add_request(f"s{i}", rand_ids(64), endless)
    for _ in range(10):  # admission and warm-up
        engine.step()
    long_ids = rand_ids(long_len)  # fresh ids: no prefix hit (drawn here: 32k draws take ~10 ms)
    long = SamplingParams(temperature=0, max_tokens=1 + LONG_ROW_TOKENS, ignore_eos=True)
    before, during, beside, t_long, ttft, last = [], [], [], None, None, time.perf_counter()
    done = False
    while not done:
        if t_long is None and len(before) >= 30:
            engine.add_request("long", long_ids, long)
            t_long = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        (before if t_long is None else during if ttft is None else beside).append(now - last)
        last = now
        for d in deltas:
            if d.request_id == "long":
                ttft = ttft or now - t_long
                done = d.finished
    for i in range(n_streams):
        engine.abort(f"s{i}")
    engine.step()
    # The control: the same schedule without the long prompt.
    for i in range(n_streams):
        engine.add_request(f"c{i}", rand_ids(64), endless)
    for _ in range(10):
        engine.step()
    control, last = [], time.perf_counter()
    for _ in range(len(before) + len(during) + len(beside)):
        engine.step()
        now = time.perf_counter()
        control.append(now - last)
        last = now
    for i in range(n_streams):
        engine.abort(f"c{i}")
    engine.step()
    engine.check_invariants()
    llm = engine = None
    _free_gpu()
    start, end = len(before), len(before) + len(during)
    row = {
        "workload": "long_context",
        "streams": n_streams,
        "long_prompt": long_len,
        "budget": budget,
        "itl_median_ms_before": 1e3 * _pct(before, 0.5),
        "itl_median_ms_without": 1e3 * _pct(control[start:end], 0.5),
        "itl_median_ms_without_beside": 1e3 * _pct(control[end:], 0.5),
        "itl_p99_ms_during": 1e3 * _pct(during, 0.99),
        "itl_median_ms_during": 1e3 * _pct(during, 0.5),
        "steps_during": len(during),
        "ttft_long_s": ttft,
        "ttft_long_alone_s": ttft_alone,
        "prefill_lane_tokens": lane.chunk if lane else 0,
        "prefill_lane_on_stream": bool(lane and lane.stream is not None),
        "prefill_lane_chunks": lane.num_launched if lane else 0,
        "prefill_lane_reserve_sms": lane.reserve_sms if lane else 0,
        "itl_median_ms_beside_long_row": 1e3 * _pct(beside, 0.5),
    }
    row["itl_p99_ratio"] = row["itl_p99_ms_during"] / row["itl_median_ms_without"]
    row["itl_p99_ratio_vs_before"] = row["itl_p99_ms_during"] / row["itl_median_ms_before"]
    row["ttft_ratio"] = ttft / ttft_alone
    row["long_row_itl_ratio"] = (
        row["itl_median_ms_beside_long_row"] / row["itl_median_ms_without_beside"]
    )
    return row


# -- end-to-end GPU workloads (latency, throughput) next to transformers and the ceilings ----


def _hf_model(path: str, dtype: torch.dtype):
    """transformers on the same shape (random init is as fast as any weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _hf_tok_per_s(model, batch: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.randint(100, 1000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - t0)


def _run_offline(llm, prompts, out_lens, temperature: float = 0.0) -> tuple[float, int]:
    from tinyserve import SamplingParams

    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(out_lens)
    ]
    warm = [p[::-1] for p in prompts[:2]]  # not the prompts themselves: no prefix-cache hits
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == list(out_lens)
    return dt, sum(out_lens)


def _steady_step_ms(llm, prompts, out_len: int, temperature: float = 0.0) -> float:
    """Mean wall ms of the engine steps that run once every prompt has its first token, to the
    end: a decode step as TPOT counts it (prefill and first tokens excluded). Every prompt has
    the same length and output length, so all rows run to the last step."""
    from tinyserve import SamplingParams

    engine = llm.engine
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature, seed=i, max_tokens=out_len, ignore_eos=True
        )
        engine.add_request(f"steady-{i}", p, params)
    started, t0, steps = set(), 0.0, 0
    while engine.has_unfinished():
        deltas = engine.step()
        if len(started) == len(prompts):
            steps += 1
        else:
            started.update(d.request_id for d in deltas if d.outputs[0].token_ids)
            t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / max(steps, 1) * 1e3


def _time_replays(graph, n: int = 200) -> float:
    """Mean ms of one replay (CUDA events around n back-to-back replays)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def _first_token_ms(llm, prompt: list[int], repeats: int = 5) -> float:
    """Fastest of `repeats` one-token generations of `prompt` (prefix caching off for them)."""
    from tinyserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(repeats):
        prompt = [prompt[0] + 1 + i] + prompt[1:]  # a new first token: no prefix-cache hit
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _batch1_replay_ms(graphs) -> dict[int, float]:
    """ms a replay of each batch-1 decode graph, by split count. A function of its own: a local
    reference to the graph set would keep the model and its KV pool alive past `del llm`
    (transformers then ran out of memory beside it)."""
    return {key[2]: round(_time_replays(g), 4) for key, g in graphs.graphs.items() if key[0] == 1}


def bench_e2e(args) -> dict:
    """latency: batch 1, 32 in / 256 out. throughput: nano-vllm (256 seqs, in/out U[100,1024]),
    decode-heavy (128 x 32/2048), prefill-heavy (32 x 4096/32). hf64: batch 64, 512/256, next
    to transformers. Weight bytes over step time give the fraction of the copy ceiling."""
    import random

    from tinyserve import LLM

    path, load_format = resolve_model(args.model)
    res = {
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "ceilings": measure_ceilings("cuda"),
        "rows": [],
    }
    print(json.dumps(res["ceilings"]), flush=True)
    llm = LLM(
        path,
        load_format=load_format,
        seed=0,
        max_num_seqs=256,
        enforce_eager=args.enforce_eager,
        prefill_lane_tokens=args.lane_tokens,
    )
    # The result says whether this run had a prefill lane. Building one leaves batch-1 decode
    # ~3% slower than a fresh engine without (qwen3-0.6b), as any torch kernel a fresh process
    # has not yet run does, e.g. one greedy request with logprobs: with programmatic dependent
    # launch only (BENCHMARKS, twenty-sixth session).
    lane = llm.engine.runner.lane
    res["prefill_lane_tokens"] = lane.chunk if lane is not None else 0
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def row(name, prompts, out_lens, **extra):
        # Warm-up on the workload's first prompts: a fresh machine's first run compiles Triton
        # variants inside the timed region (H100, nano-vllm: ~15% slower than a rerun).
        # Reversed prompts: the same lengths, no prefix-cache hits for the timed run.
        _run_offline(llm, [p[::-1] for p in prompts[:64]], [min(n, 32) for n in out_lens[:64]])
        dt, n_out = _run_offline(llm, prompts, out_lens)
        r = {
            "workload": name,
            "seqs": len(prompts),
            "out_tok_per_s": n_out / dt,
            "total_tok_per_s": (n_out + sum(map(len, prompts))) / dt,
            **extra,
        }
        res["rows"].append(r)
        print(r, flush=True)
        return r

    for name in args.workloads:
        if name == "latency":
            r = row("latency", [ids(32)], [256])
            step_s = 1 / r["out_tok_per_s"]
            r["weight_GBps"] = weight_bytes / step_s / 1e9
            r["frac_of_copy_ceiling"] = r["weight_GBps"] / res["ceilings"]["copy_GBps"]
            # Where a latency run's time goes: the prompt's step (to the first token), and the
            # batch-1 graph alone (the rest of a decode step runs outside it), per split count
            # (the run's last context, 288 keys, in each; steps pick 1-4 splits as it grows).
            r["first_token_ms"] = _first_token_ms(llm, ids(32))
            graphs = llm.engine.runner.graphs
            if graphs is not None:
                r["graph_replay_ms"] = _batch1_replay_ms(graphs)
            keys = ("first_token_ms", "graph_replay_ms")
            print({k: r.get(k) for k in keys}, flush=True)
        elif name == "nano-vllm":
            lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
            row("nano-vllm", [ids(i) for i, _ in lens], [o for _, o in lens])
        elif name == "decode-heavy":
            row("decode-heavy", [ids(32) for _ in range(128)], [2048] * 128)
        elif name == "prefill-heavy":
            row("prefill-heavy", [ids(4096) for _ in range(32)], [32] * 32)
        elif name == "hf64":
            row("batch64", [ids(512) for _ in range(64)], [256] * 64)
    if args.compare_hf:
        del llm
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        print({"gpu_GiB_still_allocated": torch.cuda.memory_allocated() / 2**30}, flush=True)
        hf = _hf_model(path, torch.bfloat16)
        for r in res["rows"]:
            if r["workload"] == "latency":
                r["transformers_tok_per_s"] = _hf_tok_per_s(hf, 1, 32, 256)
            elif r["workload"] == "batch64":
                r["transformers_tok_per_s"] = _hf_tok_per_s(hf, 64, 512, 256)
            else:
                continue
            r["ratio_vs_transformers"] = r["out_tok_per_s"] / r["transformers_tok_per_s"]
            print(r, flush=True)
    return res


# -- speculative decoding ------------------------------------------------------------------------

EDIT_TEXTS = [
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was very hapy. "
    "The dog did not care at all, it kept sleeping under the old oak tree near the river.",
    "Our team will meet on monday at 10 am to discus the new budjet. Please bring your laptops "
    "and the reports from last quarter, and send me any questions before the meeting.",
    "def add(a, b):\n    retrun a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3))\n"
    "print(mul(4, 5))\n",
    "Water boils at 100 degres Celsius at sea level. At higher altitudes the air presure is "
    "lower, so water boils at a lower temperture and food takes longer to cook.",
]


def bench_spec(args) -> dict:
    """CPU (default model): n-gram speculation on edit prompts (the answer repeats the prompt) at
    batch 1 vs plain decode, outputs checked identical. GPU (--model mimo-7b): per batch size,
    the step time of MTP speculation with acceptance forced to 0 vs plain decode (the overhead),
    and tokens/s with acceptance forced to 0..k (the mechanism's ceiling)."""
    from tinyserve import LLM

    path, load_format = resolve_model(args.model)
    if load_format == "auto":
        return _spec_ngram_cpu(path, args)
    import random

    res = {"device": torch.cuda.get_device_name(), "model": args.model, "rows": []}
    vocab = SHAPES[args.model]["vocab_size"]
    rng = random.Random(0)
    new = args.new_tokens
    plain = {}
    runs = [(None, 0)] + [(k, v) for k in args.spec_k for v in args.draft_vocab]
    for k, draft_vocab in runs:
        spec = dict(speculative_method="mtp", num_speculative_tokens=k) if k else {}
        if draft_vocab:  # dummy weights: which ids make no difference to the cost
            spec["speculative_token_map"] = token_map = os.path.join(args.out, "token_map.json")
            os.makedirs(args.out, exist_ok=True)
            with open(token_map, "w") as f:
                json.dump(list(range(draft_vocab)), f)
        llm = LLM(path, load_format=load_format, seed=0, max_num_seqs=max(args.batches), **spec)
        # As served (cli.py freezes the start-up heap): a full collection over it took 90-130 ms
        # on the H100 host, a stall of the GPU that once landed in these rows (BENCHMARKS.md).
        _as_served(llm.engine)
        for b in args.batches:
            n_in = args.prompt_len
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
            for f in range(k + 1) if k else [None]:
                llm.engine.config.spec_force_accept = f
                # Warm-up: first-use Triton compiles of this batch's eager shapes would land in
                # the first timed run (they made f = 0 look 2.5 ms a step slower than f = 1).
                # Past 64 keys, so eager decode steps also meet a split count above one.
                warm = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
                temp = args.temperature
                _run_offline(llm, warm, [min(new, 48)] * b, temp)  # other prompts: no prefix hits
                dt, n_out = _run_offline(llm, prompts, [new] * b, temp)
                steps = -(-new // (f + 1)) if k else new
                again = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
                r = {
                    "batch": b,
                    "prompt_len": n_in,
                    "k": k or 0,
                    "forced_accept": f,
                    "draft_vocab": draft_vocab or vocab,
                    "temperature": temp,
                    "out_tok_per_s": n_out / dt,
                    "step_ms": dt / steps * 1e3,  # the whole run (prefill included) per step
                    "steady_step_ms": _steady_step_ms(llm, again, new, temp),
                }
                if not k:
                    plain[b] = r
                else:
                    r["step_vs_plain"] = r["step_ms"] / plain[b]["step_ms"]
                    r["steady_step_vs_plain"] = r["steady_step_ms"] / plain[b]["steady_step_ms"]
                    r["tok_per_s_vs_plain"] = r["out_tok_per_s"] / plain[b]["out_tok_per_s"]
                res["rows"].append(r)
                print(r, flush=True)
        del llm
        _free_gpu()
    return res


def _spec_ngram_cpu(path: str, args) -> dict:
    from tinyserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    msgs = [
        [
            {
                "role": "user",
                "content": "Fix the typos in this text and repeat it in full, "
                f"changing nothing else.\n\n{t}",
            }
        ]
        for t in EDIT_TEXTS
    ]
    res = {"device": "cpu", "model": path, "rows": []}
    ref = None
    for k in [None, *args.spec_k]:
        spec = dict(speculative_method="ngram", num_speculative_tokens=k) if k else {}
        llm = LLM(path, device="cpu", **spec)
        llm.chat(msgs[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        t0, outs = time.perf_counter(), []
        for m in msgs:  # batch 1: one request at a time
            outs.append(llm.chat(m, params, use_tqdm=False)[0])
        dt = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        if ref is None:
            ref = ids
        r = {
            "batch": 1,
            "method": "ngram" if k else "off",
            "k": k or 0,
            "out_tok_per_s": sum(map(len, ids)) / dt,
            "identical_to_plain": ids == ref,
        }
        if k:
            s = llm.engine.spec.stats
            r["acceptance"] = s.num_accepted_tokens / max(1, s.num_draft_tokens)
            r["mean_accepted_length"] = s.mean_accepted_length
            r["speedup"] = r["out_tok_per_s"] / res["rows"][0]["out_tok_per_s"]
        res["rows"].append(r)
        print(r, flush=True)
    return res


# -- serve: an online client against a running `tinyserve run` (vLLM's metric definitions) -------
# TTFT: request sent -> first chunk with text. ITL: gaps between successive text chunks, pooled
# over requests. TPOT per request: (E2E latency - TTFT) / (output tokens - 1). Throughputs over
# the run's wall time. /health is probed from a separate process the whole time (loop latency).


def bench_serve(args) -> dict:
    import asyncio

    return {"server": args.url, "rows": asyncio.run(_serve_sweep(args))}


async def _serve_sweep(args) -> list[dict]:
    import random

    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        args.url, headers=headers, timeout=timeout, connector=conn
    ) as session:
        async with session.get("/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        lo, hi = 1 - args.range_ratio, 1 + args.range_ratio
        await _serve_one(session, model, list(range(1000, 1016)), 4)  # warm-up
        rows = []
        for rate in args.request_rate:
            for conc in args.concurrency:
                # new random prompts per run, so no run hits the previous one's prefix cache
                rng = random.Random(len(rows))
                reqs = [
                    (
                        [
                            rng.randrange(1000, 30000)
                            for _ in range(max(1, round(args.input_len * rng.uniform(lo, hi))))
                        ],
                        max(1, round(args.output_len * rng.uniform(lo, hi))),
                    )
                    for _ in range(args.num_prompts)
                ]
                rows.append(await _serve_run(session, model, reqs, rate, conc, args))
                print(json.dumps(rows[-1]))
        return rows


async def _serve_one(session, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    chunk_times, num_out = [], 0
    async with session.post("/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                num_out = event["usage"]["completion_tokens"]
            choice = event["choices"][0] if event["choices"] else None
            # a chunk per token; a model without a tokenizer streams chunks with empty text
            if choice and (choice["text"] or choice.get("finish_reason") is None):
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    if not chunk_times:
        return {"ok": False}
    ttft = chunk_times[0] - t0
    return {
        "ok": True,
        "ttft": ttft,
        "e2el": end - t0,
        "num_out": num_out,
        "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
        "tpot": (end - t0 - ttft) / (num_out - 1) if num_out > 1 else None,
    }


async def _serve_run(session, model: str, reqs, rate: float, conc: int, args) -> dict:
    import asyncio
    import multiprocessing
    import random

    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=_probe_health, args=(args.url, args.health_hz, stop, out))
    probe.start()
    sem = asyncio.Semaphore(conc)
    rng = random.Random(1)

    async def limited(prompt, max_tokens):
        async with sem:
            return await _serve_one(session, model, prompt, max_tokens)

    t0 = time.perf_counter()
    tasks = []
    for prompt, max_tokens in reqs:  # Poisson arrivals at `rate` req/s (inf: all at once)
        tasks.append(asyncio.ensure_future(limited(prompt, max_tokens)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    stop.set()
    health = await asyncio.get_running_loop().run_in_executor(None, out.get)
    probe.join()
    done = [r for r in results if r["ok"]]
    ms = 1e3
    num_out = sum(r["num_out"] for r in done)
    num_in = sum(len(p) for (p, _), r in zip(reqs, results) if r["ok"])
    itl = [x for r in done for x in r["itl"]]
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    return {
        "rate": rate,
        "concurrency": conc,
        "num_prompts": len(reqs),
        "completed": len(done),
        "duration_s": duration,
        "req_per_s": len(done) / duration,
        "out_tok_per_s": num_out / duration,
        "total_tok_per_s": (num_in + num_out) / duration,
        "ttft_median_ms": _pct([r["ttft"] for r in done], 0.5) * ms,
        "ttft_p99_ms": _pct([r["ttft"] for r in done], 0.99) * ms,
        "tpot_median_ms": _pct(tpot, 0.5) * ms,
        "tpot_p99_ms": _pct(tpot, 0.99) * ms,
        "itl_median_ms": _pct(itl, 0.5) * ms,
        "itl_p99_ms": _pct(itl, 0.99) * ms,
        "e2el_median_ms": _pct([r["e2el"] for r in done], 0.5) * ms,
        "health_n": len(health),
        "health_p50_ms": _pct(health, 0.5) * ms,
        "health_p99_ms": _pct(health, 0.99) * ms,
        "health_max_ms": max(health, default=0) * ms,
    }


def _probe_health(url: str, hz: float, stop, out) -> None:
    """GET /health at `hz` on one keep-alive connection until `stop`; put the latencies (s)."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
    lat = []
    while not stop.is_set():
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        lat.append(time.perf_counter() - t0)
        time.sleep(max(0.0, 1 / hz - (time.perf_counter() - t0)))
    out.put(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("workload", choices=["cpu", "kernels", "prefix", "e2e", "serve", "spec", "pool"])
    p.add_argument(
        "--spec-k",
        type=int,
        nargs="+",
        default=[1, 3],
        help="spec: numbers of speculative tokens to run",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["latency", "hf64", "nano-vllm", "decode-heavy", "prefill-heavy"],
        help="e2e: which rows",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        nargs="+",
        default=[0],
        help="spec (MTP): draft from a token map of this many ids (0: the whole "
        "vocabulary); each value is a run",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="spec: sampling temperature (0: greedy; seeded)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="e2e: no CUDA graphs")
    p.add_argument("--only", nargs="+", default=None, help="kernels: rows whose name has a word")
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32, help="spec: prompt tokens per sequence")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default="bench-results")
    p.add_argument("--small", action="store_true", help="prefix: the CPU sizes")
    p.add_argument("--max-num-seqs", type=int, default=512, help="prefix: the engine's cap")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="prefix: fresh workload sets per engine (0: long context only)",
    )
    p.add_argument(
        "--long-budget",
        type=int,
        default=512,
        help="prefix: max_num_batched_tokens of the long-context run (0: skip it)",
    )
    p.add_argument(
        "--long-len",
        type=int,
        default=None,
        help="prefix: the long prompt's tokens (default 32,768; 4,096 with --small)",
    )
    p.add_argument(
        "--lane-tokens",
        type=int,
        default=None,
        help="prefix (the long-context run) "
        "and e2e: prefill_lane_tokens (default: the engine's; 0: no lane)",
    )
    p.add_argument(
        "--lane-reserve-sms",
        type=int,
        default=None,
        help="prefix: the long-context run's prefill_lane_reserve_sms",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="serve: the server")
    p.add_argument("--api-key", default=None, help="serve: bearer key, if the server has one")
    p.add_argument("--num-prompts", type=int, default=128, help="serve: requests per run")
    p.add_argument("--input-len", type=int, default=128, help="serve: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="serve: generated tokens")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="serve: lengths uniform in len * [1 - r, 1 + r] (0: fixed)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="serve: Poisson arrival rates (req/s; inf: all at once)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[64],
        help="serve: max in-flight requests to sweep",
    )
    p.add_argument("--health-hz", type=float, default=20, help="serve: /health probe rate")
    args = p.parse_args()
    run = {
        "cpu": bench_cpu,
        "kernels": bench_kernels,
        "prefix": bench_prefix,
        "e2e": bench_e2e,
        "serve": bench_serve,
        "spec": bench_spec,
        "pool": bench_pool,
    }
    run = run[args.workload]
    result = run(args)
    res = {
        "workload": args.workload,
        "commit": git_commit(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        **result,
    }
    print(json.dumps(res.get("ceilings", {})))
    for row in res["rows"]:
        print(
            "  ".join(
                f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    os.makedirs(args.out, exist_ok=True)
    tag = f"{args.workload}-{args.model}" if args.model in SHAPES else args.workload
    path = os.path.join(args.out, f"{tag}-{res['commit']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
