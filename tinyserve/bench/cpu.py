"""`bench.py cpu`: SmolLM2-135M (or --model) greedy decode at each of --batches, per --dtypes,
next to transformers `generate` on the same prompts (--compare-hf), with this machine's copy and
GEMM ceilings. Rows: batch, new_tokens, tinyserve_<dtype> and transformers_float32 (tok/s)."""

from __future__ import annotations

import os
import time

import torch

from tinyserve.bench.common import measure_ceilings


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
