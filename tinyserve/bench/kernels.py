"""`bench.py kernels` (CUDA): each Triton kernel vs its torch version (eager, torch.compile where
it applies) at real shapes, bf16, timed as CUDA-graph replays over input sets rotated out of L2;
a row per kernel and shape with GB/s and the fraction of the measured copy rate. The kernels
themselves are listed in kernels_attention.py, kernels_ops.py and kernels_hybrid.py."""

from __future__ import annotations

import json

import torch

from tinyserve.bench.common import measure_ceilings


def graph_us(fn, sets, reps: int = 25) -> float:
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


def kernel_row(res, name, shape, nbytes, flops, make_set, triton_fn, torch_fns, **extra):
    """Times triton_fn and each torch version on the same input sets; appends one row."""
    if res.get("only") and not any(word in name for word in res["only"]):
        return
    sets = [make_set() for _ in range(max(1, min(64, -(-(256 << 20) // nbytes))))]
    row = {"kernel": name, "shape": shape, **extra}
    for label, fn in [("triton", triton_fn), *torch_fns.items()]:
        try:
            row[f"{label}_us"] = round(graph_us(fn, sets), 2)
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


def sweep(res, name, shape, nbytes, make_set, fn, cfgs) -> None:
    """One row per launcher config (keyword arguments), timed like the default."""
    for cfg in cfgs:
        kernel_row(
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


def bench_kernels(args) -> dict:
    """Each Triton kernel vs its torch version (eager, torch.compile where it applies) at real
    shapes, bf16, timed as CUDA-graph replays; GB/s and the fraction of the measured copy rate."""
    from tinyserve.bench.kernels_attention import bench_attention
    from tinyserve.bench.kernels_hybrid import bench_hybrid
    from tinyserve.bench.kernels_ops import bench_small_ops

    assert torch.cuda.is_available(), "the kernels workload needs a CUDA device"
    torch.manual_seed(0)
    res = {
        "device": torch.cuda.get_device_name(),
        "ceilings": measure_ceilings("cuda"),
        "rows": [],
        "only": args.only,
    }
    print(json.dumps(res["ceilings"]), flush=True)
    bench_attention(res)
    bench_small_ops(res)
    bench_hybrid(res)
    return res
