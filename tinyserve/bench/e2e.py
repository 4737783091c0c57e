"""`bench.py e2e` (CUDA): the engine on model shapes with dummy weights (--model qwen3-0.6b ...),
one row per --workloads name: latency (batch 1), nano-vllm, decode-heavy, prefill-heavy, hf64
(batch 64, next to transformers), decode (one row per --batches value: throughput vs batch).
Weight bytes over step time give the fraction of the copy ceiling."""

from __future__ import annotations

import json
import time

import torch

from tinyserve.bench.common import measure_ceilings, resolve_model
from tinyserve.bench.drive import run_offline

MAX_NUM_SEQS = 256  # the engine's cap on running sequences in every e2e row


def _hf_model(path: str, dtype: torch.dtype):
    """transformers on the same shape (random init is as fast as any weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _hf_tok_per_s(
    model, batch: int, prompt_len: int, new_tokens: int, total: bool = False
) -> float:
    """transformers' generated tokens per second (prompt tokens too with `total`)."""
    ids = torch.randint(100, 1000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    return batch * (new_tokens + prompt_len * total) / (time.perf_counter() - t0)


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
    to transformers. decode: a row per --batches value, B x 32 / --new-tokens. Weight bytes
    over step time give the fraction of the copy ceiling."""
    import random

    from tinyserve import LLM

    if "decode" in args.workloads and max(args.batches) > MAX_NUM_SEQS:
        raise SystemExit(f"e2e decode: --batches up to {MAX_NUM_SEQS} (the engine's max_num_seqs)")
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
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=args.enforce_eager,
        prefill_lane_tokens=args.lane_tokens,
    )
    # The result says whether this run had a prefill lane: building one runs torch kernels a
    # fresh process has not run yet, which slows batch-1 decode by a few percent (BENCHMARKS.md,
    # GPU end to end).
    runner = llm.engine.runner  # (no local may outlive `del llm`: it would keep the KV pool)
    res["prefill_lane_tokens"] = runner.lane.chunk if runner.lane is not None else 0
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def ids(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def row(name, prompts, out_lens, **extra):
        # Warm-up on the workload's first prompts: a fresh machine's first run would compile
        # Triton variants inside the timed region. Reversed prompts: the same lengths, no
        # prefix-cache hits for the timed run.
        run_offline(llm, [p[::-1] for p in prompts[:64]], [min(n, 32) for n in out_lens[:64]])
        dt, n_out = run_offline(llm, prompts, out_lens)
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
            if runner.graphs is not None:
                r["graph_replay_ms"] = _batch1_replay_ms(runner.graphs)
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
        elif name == "decode":  # throughput vs batch size: B x 32 in / --new-tokens out
            for b in args.batches:
                row("decode", [ids(32) for _ in range(b)], [args.new_tokens] * b, batch=b)
    if args.compare_hf:
        del llm, runner
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
            elif r["workload"] == "prefill-heavy":  # prompt tokens dominate: compare totals
                try:
                    hf_total = _hf_tok_per_s(hf, 32, 4096, 32, total=True)
                except torch.OutOfMemoryError:  # it keeps whole-batch activations
                    r["transformers_tok_per_s"] = "out of memory"
                    torch.cuda.empty_cache()
                    print(r, flush=True)
                    continue
                r["transformers_total_tok_per_s"] = hf_total
                r["ratio_vs_transformers"] = r["total_tok_per_s"] / hf_total
                print(r, flush=True)
                continue
            else:
                continue
            r["ratio_vs_transformers"] = r["out_tok_per_s"] / r["transformers_tok_per_s"]
            print(r, flush=True)
    return res
