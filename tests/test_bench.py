"""bench.py on the CPU: the workloads that run here write the JSON they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, *args: str) -> dict:
    subprocess.run(
        [sys.executable, "bench.py", *args, "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    (name,) = os.listdir(tmp_path)
    with open(tmp_path / name) as f:
        return json.load(f)


def test_pool_counts_host_cost_with_and_without_the_cache(tmp_path):
    res = run_bench(tmp_path, "pool")
    assert res["workload"] == "pool"
    on, off, hit = res["rows"]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["us_per_block"] > 0 and off["us_per_block"] > 0
    assert hit["prefix_hit_us_per_matched_block"] > 0


def test_spec_ngram_on_the_default_model_is_lossless(tmp_path):
    """Edit-style prompts on real SmolLM2 weights: n-gram speculation gives plain decode's
    tokens and reports its acceptance."""
    res = run_bench(tmp_path, "spec", "--new-tokens", "12", "--spec-k", "2")
    plain, ngram = res["rows"]
    assert (plain["method"], ngram["method"], ngram["k"]) == ("off", "ngram", 2)
    assert plain["identical_to_plain"] and ngram["identical_to_plain"]
    assert 0 <= ngram["acceptance"] <= 1 and ngram["out_tok_per_s"] > 0


def test_prefix_long_context_alone(tmp_path):
    """--repeats 0: the long-context run only (decoding streams, then a long prompt chunked
    beside them, which then decodes beside them), with its ITL and TTFT ratios. "Without" is
    a control run: the same streams over the same steps, no long prompt (their contexts grow
    meanwhile, so the steps before the prompt are not the baseline)."""
    res = run_bench(
        tmp_path,
        "prefix",
        "--small",
        "--repeats",
        "0",
        "--long-budget",
        "256",
        "--long-len",
        "1536",
    )
    (row,) = res["rows"]
    assert row["workload"] == "long_context" and row["steps_during"] > 1
    assert row["long_prompt"] == 1536
    assert row["itl_p99_ms_during"] >= row["itl_median_ms_during"] > 0
    assert row["ttft_ratio"] == row["ttft_long_s"] / row["ttft_long_alone_s"]
    assert row["prefill_lane_tokens"] == 0  # off by default on the CPU
    assert row["itl_median_ms_before"] > 0 and row["itl_median_ms_without"] > 0
    assert row["itl_p99_ratio"] == row["itl_p99_ms_during"] / row["itl_median_ms_without"]
    assert row["itl_p99_ratio_vs_before"] == (
        row["itl_p99_ms_during"] / row["itl_median_ms_before"]
    )
    # Then the long prompt decodes beside the streams (one long row among short ones).
    assert row["itl_median_ms_beside_long_row"] > 0
    assert row["long_row_itl_ratio"] == (
        row["itl_median_ms_beside_long_row"] / row["itl_median_ms_without_beside"]
    )


def test_prefix_long_context_on_the_prefill_lane(tmp_path):
    """--lane-tokens: the long prompt's chunks go through the lane (eagerly on the CPU): all
    of it but its admission chunk and its last token, 1,536 - 256 tokens in 384-token chunks."""
    res = run_bench(
        tmp_path,
        "prefix",
        "--small",
        "--repeats",
        "0",
        "--long-budget",
        "256",
        "--long-len",
        "1536",
        "--lane-tokens",
        "384",
    )
    (row,) = res["rows"]
    assert row["prefill_lane_tokens"] == 384 and not row["prefill_lane_on_stream"]
    assert row["prefill_lane_chunks"] == 4


def test_unknown_workload_is_refused():
    out = subprocess.run(
        [sys.executable, "bench.py", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_steady_step_time_leaves_out_the_prefill():
    """bench.py spec's steady_step_ms: the mean of the steps after every prompt's first token
    (a 100 ms prefill step, then 5 ms steps, gives ~5 ms, not the whole run per step)."""
    import time
    from types import SimpleNamespace

    sys.path.append(ROOT)  # last: its kernels/ must not shadow transformers' `kernels`
    import bench

    class Engine:
        def __init__(self) -> None:
            self.ids, self.left = [], 6

        def add_request(self, rid, prompt, params) -> None:
            self.ids.append(rid)

        def has_unfinished(self) -> bool:
            return self.left > 0

        def step(self):
            first = self.left == 6
            time.sleep(0.1 if first else 0.005)
            self.left -= 1
            out = SimpleNamespace(token_ids=[1])
            return [SimpleNamespace(request_id=r, outputs=[out]) for r in self.ids]

    ms = bench._steady_step_ms(SimpleNamespace(engine=Engine()), [[1], [2]], 6)
    assert 4.5 < ms < 12, ms  # 5 steps of ~5 ms; with the prefill step it would be ~21 ms


def test_e2e_builds_the_engine_with_lane_tokens_and_says_so(monkeypatch):
    """--lane-tokens reaches e2e's engine, and the result records the lane it had (building
    one costs batch-1 decode ~2.5% on the H100). The CUDA-only parts are stubbed and no
    workload runs: only the engine is built, on the CPU with the default model, whose 8,192
    positions leave room for a lane only under a smaller step budget (set here)."""
    import argparse

    import torch

    import tinyserve

    sys.path.append(ROOT)  # last: its kernels/ must not shadow transformers' `kernels`
    import bench

    llm_cls = tinyserve.LLM
    monkeypatch.setattr(
        tinyserve, "LLM", lambda *a, **kw: llm_cls(*a, max_num_batched_tokens=256, **kw)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: {})
    for lane_tokens, want in ((None, 0), (1024, 1024)):  # the CPU has no lane by default
        args = argparse.Namespace(
            model=None, enforce_eager=False, lane_tokens=lane_tokens, workloads=[], compare_hf=False
        )
        assert bench.bench_e2e(args)["prefill_lane_tokens"] == want


def test_bench_puts_its_checkout_last_on_sys_path():
    """`python bench.py` starts with the checkout first on sys.path; bench moves it last, so the
    checkout's kernels/ cannot shadow the PyPI `kernels` package that transformers (>= 5.25)
    imports: where that package is installed, `import kernels` finds it."""
    import importlib.metadata

    code = (
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); import bench; "
        "print(sys.path.index(sys.argv[1]) == len(sys.path) - 1, "
        "importlib.util.find_spec('kernels').origin)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, ROOT],
        cwd="/",
        text=True,
        capture_output=True,
        check=True,
        timeout=120,
    )
    last, origin = run.stdout.split()
    assert last == "True"
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # not installed (transformers < 5.25): the checkout's is the only one
    assert not origin.startswith(os.path.join(ROOT, "kernels", ""))  # (a venv may sit in ROOT)
