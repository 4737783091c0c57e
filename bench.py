"""tinyserve benchmarks: `python bench.py WORKLOAD [options]`, a table on stdout and JSON on disk.

Workloads:
  cpu   SmolLM2-135M (or --model) greedy decode at batch 1 and batch 32 next to transformers
        `generate` on the same prompts, with this machine's measured copy and GEMM ceilings.
Every figure is measured in this run; ratios compare numbers from this same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)))  # fmt: skip
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def measure_ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and GEMM rate in fp32 and bf16 on this device."""
    n = 64 << 20 if device == "cpu" else 1 << 30
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
    topics = ["the ocean", "a city at night", "mathematics", "an old library", "mountains",
              "a robot", "bread baking", "the stars"]  # fmt: skip
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
    kw = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
              pad_token_id=pad)  # fmt: skip
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=4,
                       do_sample=False, pad_token_id=pad)  # fmt: skip
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    assert out.shape[1] - width == new_tokens
    return len(prompts) * new_tokens / dt


def bench_cpu(args) -> dict:
    from tinyserve import LLM
    from tinyserve.gguf import default_model_path

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("workload", choices=["cpu"])
    p.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compare-hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()
    res = {"workload": args.workload, "commit": git_commit(), "machine": platform.processor()
           or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), **bench_cpu(args)}  # fmt: skip
    print(json.dumps(res["ceilings"]))
    for row in res["rows"]:
        print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()))  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.workload}-{res['commit']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
