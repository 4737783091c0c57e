"""`bench.py memory` (CUDA): the KV cache an engine sizes for each --utilizations value and the
device memory the whole process then holds, which `gpu_memory_utilization` bounds as vLLM's
does (weights + peak forward activations + KV cache + state slots)."""

from __future__ import annotations

import torch

from tinyserve.bench.common import resolve_model
from tinyserve.bench.drive import free_gpu


def bench_memory(args) -> dict:
    from tinyserve import LLM

    path, load_format = resolve_model(args.model)
    res = {"device": torch.cuda.get_device_name(), "model": args.model, "rows": []}
    for util in args.utilizations:
        llm = LLM(path, load_format=load_format, gpu_memory_utilization=util)
        free, total = torch.cuda.mem_get_info()
        row = {
            "workload": "kv_sizing",
            "gpu_memory_utilization": util,
            "kv_tokens": llm.engine.kv_capacity_tokens,
            "used_frac": (total - free) / total,
            "total_GiB": total / 2**30,
        }
        res["rows"].append(row)
        print(row, flush=True)
        del llm
        free_gpu()
    return res
