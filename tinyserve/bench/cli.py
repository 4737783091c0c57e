"""The command line of `python bench.py`: parse the flags, run one workload, print its table and
write its JSON (`--out`), then its plots (`--plot`, into `--plot-dir`). `bench.py plot FILE`
draws the plots of a saved result instead, on any machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from tinyserve.bench import plot
from tinyserve.bench.common import SHAPES, git_commit
from tinyserve.bench.cpu import bench_cpu
from tinyserve.bench.e2e import bench_e2e
from tinyserve.bench.hybrid_prefix import CACHE_RUNS, bench_hybrid_prefix
from tinyserve.bench.hybrid_prefix import WORKLOADS as HYBRID_WORKLOADS
from tinyserve.bench.kernels import bench_kernels
from tinyserve.bench.memory import bench_memory
from tinyserve.bench.pool import bench_pool
from tinyserve.bench.prefix import bench_prefix
from tinyserve.bench.serve import bench_serve
from tinyserve.bench.spec import bench_spec
from tinyserve.bench.structured import bench_structured

DESCRIPTION = """\
tinyserve benchmarks: `python bench.py WORKLOAD [options]`, a table on stdout and JSON on disk.

Workloads:
  cpu   SmolLM2-135M (or --model) greedy decode at batch 1 and batch 32 next to transformers
        `generate` on the same prompts, with this machine's measured copy and GEMM ceilings.
  kernels  (CUDA) each Triton kernel in kernels/ vs its torch version (eager, torch.compile)
        at real shapes, timed as CUDA-graph replays, as GB/s and a fraction of the copy rate.
  e2e   (CUDA) the engine on model shapes with dummy weights (--model qwen3-0.6b ...): latency
        (batch 1), nano-vllm, decode-heavy, prefill-heavy, batch 64 vs transformers, and
        decode (a row per --batches value) (--workloads).
  prefix  prefix caching on vs off (shared prefix, no sharing; --repeats fresh sets) and the
        long-context interleaving run (--long-budget; 0 skips it: streams decode, a long prompt
        arrives, then decodes beside them). --small: the CPU sizes.
  hybrid-prefix  a hybrid model's prefix cache (Qwen3.5: resumes from recurrent-state
        checkpoints) on vs off, a row per workload and setting with the hit rate measured and
        its block-granular ideal, TTFT median / p99, throughput (--prefix-workloads): shared
        (16 groups x 32 requests, 2,048-token system prompts; also with no decode checkpoint
        saves: their cost on decode throughput), multiturn (64 chats x 4 turns, each turn
        prompt + answer + a new message), suffix (a 2,048-token prompt + 64 distinct 400-token
        suffixes), suffix-mtp (the same with MTP, k=1; a named shape's -mtp variant).
        --small: the CPU sizes; --model DIR: e.g. a tiny random Qwen3.5 checkpoint.
  spec  speculative decoding: n-gram on edit prompts (CPU), or MTP on --model mimo-7b with
        acceptance forced to 0..k (GPU).
  pool  the block pool's host cost per KV block, prefix caching on vs off, and the objects the
        cyclic GC tracks with the cache full.
  serve  an online client against a running `tinyserve run` (--url): request-rate and
        concurrency sweeps over random or fixed lengths; TTFT, TPOT, ITL (median, p99) and
        throughput as vLLM defines them, and /health latency probed during the run.
  memory  (CUDA) the KV cache sized for each --utilizations value (gpu_memory_utilization) and
        the device memory the process then holds.
  structured  a JSON-schema constraint's cost on decode throughput per --batches value: the
        same prompts and output lengths with and without the schema (--temperatures; a named
        shape needs --tokenizer DIR).
Every figure is measured in this run; ratios compare numbers from this same run.

Plots (matplotlib: pip install tinyserve[bench]): --plot writes throughput_vs_batch.png (rows
over --batches: cpu, e2e decode, spec) and itl_during_prefill.png (prefix's long-context run)
into --plot-dir. `python bench.py plot RESULT.json [--plot-dir DIR]` draws them from a saved
result.
"""

WORKLOADS = {
    "cpu": bench_cpu,
    "kernels": bench_kernels,
    "prefix": bench_prefix,
    "hybrid-prefix": bench_hybrid_prefix,
    "e2e": bench_e2e,
    "serve": bench_serve,
    "spec": bench_spec,
    "pool": bench_pool,
    "structured": bench_structured,
    "memory": bench_memory,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("workload", choices=list(WORKLOADS))
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
        "--temperatures",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="structured: sampling temperatures to run",
    )
    p.add_argument(
        "--utilizations",
        type=float,
        nargs="+",
        default=[0.5, 0.9],
        help="memory: gpu_memory_utilization values",
    )
    p.add_argument("--tokenizer", default=None, help="structured: tokenizer dir for a shape")
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
    p.add_argument("--small", action="store_true", help="prefix, hybrid-prefix: the CPU sizes")
    p.add_argument(
        "--max-num-seqs", type=int, default=512, help="prefix, hybrid-prefix: the engine's cap"
    )
    p.add_argument(
        "--prefix-workloads",
        nargs="+",
        choices=HYBRID_WORKLOADS,
        default=list(HYBRID_WORKLOADS),
        help="hybrid-prefix: which workloads",
    )
    p.add_argument(
        "--cache-runs",
        nargs="+",
        choices=CACHE_RUNS,
        default=list(CACHE_RUNS),
        help="hybrid-prefix: which cache settings run (ratios need on and off in one call)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="hybrid-prefix: the step's token budget (default: the engine's per device)",
    )
    p.add_argument(
        "--prefix-cache-state-budget",
        type=int,
        default=None,
        help="hybrid-prefix: checkpoint rows of the cache-on runs (default: the engine's)",
    )
    p.add_argument(
        "--prefix-cache-decode-state-interval",
        type=int,
        default=None,
        help="hybrid-prefix: decode saves every this many blocks in the cache-on run (default: "
        "the engine's; the on_no_decode_saves run uses 0)",
    )
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
    p.add_argument(
        "--plot",
        action="store_true",
        help="after the run, write the plots its result supports (matplotlib)",
    )
    p.add_argument("--plot-dir", default="docs/img", help="where --plot writes its PNGs")
    return p


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.py plot", description="Draw the plots of a saved bench.py result (JSON)."
    )
    p.add_argument("result", help="a JSON file bench.py wrote (--out)")
    p.add_argument("--plot-dir", default="docs/img", help="where to write the PNGs")
    return p


def write_plots(res: dict, plot_dir: str) -> list[str]:
    try:
        paths = plot.plot_result(res, plot_dir)
    except ImportError as e:
        raise SystemExit(f"bench.py: {e}") from None
    for path in paths:
        print("wrote", path)
    return paths


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        args = plot_parser().parse_args(argv[1:])
        with open(args.result) as f:
            res = json.load(f)
        if not write_plots(res, args.plot_dir):
            raise SystemExit(f"bench.py plot: nothing to plot in {args.result}")
        return
    args = build_parser().parse_args(argv)
    if args.plot:
        try:
            plot.require_matplotlib()
        except ImportError as e:
            raise SystemExit(f"bench.py: {e}") from None
    result = WORKLOADS[args.workload](args)
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
    if args.plot and not write_plots(res, args.plot_dir):
        print(f"--plot: nothing to plot for {args.workload} (needs rows over two or more")
        print("  --batches, or prefix's long-context run)")
