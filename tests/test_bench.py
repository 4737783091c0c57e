"""bench.py on the CPU: the workloads that run here write the JSON they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
    from tinyserve.bench.common import pct

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
    # The timeline the ITL plot draws: its step gaps are the intervals the row's figures are
    # taken over (ends rounded to 1 us), and the streams got tokens at every step.
    tl = res["long_context_timeline"]
    ends, served = tl["step_end_s"], tl["streams_with_tokens"]
    assert len(ends) == len(served) == len(tl["control_step_end_s"]) > row["steps_during"]
    assert ends == sorted(ends) and tl["control_step_end_s"] == sorted(tl["control_step_end_s"])
    assert 0 < tl["long_arrival_s"] < tl["long_first_token_s"] < tl["long_finished_s"] == ends[-1]
    assert set(served) == set(tl["control_streams_with_tokens"]) == {row["streams"]}
    gaps = [b - a for a, b in zip([0.0, *ends], ends)]
    during = [g for g, t in zip(gaps, ends) if tl["long_arrival_s"] < t <= tl["long_first_token_s"]]
    assert len(during) == row["steps_during"]
    assert abs(1e3 * pct(during, 0.99) - row["itl_p99_ms_during"]) < 0.01


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

    from tinyserve.bench.drive import steady_step_ms

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

    ms = steady_step_ms(SimpleNamespace(engine=Engine()), [[1], [2]], 6)
    assert 4.5 < ms < 12, ms  # 5 steps of ~5 ms; with the prefill step it would be ~21 ms


def test_e2e_builds_the_engine_with_lane_tokens_and_says_so(monkeypatch):
    """--lane-tokens reaches e2e's engine, and the result records the lane it had (building
    one slows batch-1 decode a little: BENCHMARKS.md). The CUDA-only parts are stubbed and no
    workload runs: only the engine is built, on the CPU with the default model, whose 8,192
    positions leave room for a lane only under a smaller step budget (set here)."""
    import argparse

    import torch

    import tinyserve
    from tinyserve.bench import e2e

    llm_cls = tinyserve.LLM
    monkeypatch.setattr(
        tinyserve, "LLM", lambda *a, **kw: llm_cls(*a, max_num_batched_tokens=256, **kw)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(e2e, "measure_ceilings", lambda device: {})
    for lane_tokens, want in ((None, 0), (1024, 1024)):  # the CPU has no lane by default
        args = argparse.Namespace(
            model=None, enforce_eager=False, lane_tokens=lane_tokens, workloads=[], compare_hf=False
        )
        assert e2e.bench_e2e(args)["prefill_lane_tokens"] == want


def _synthetic_result() -> dict:
    """A cpu result over three batch sizes and a long-context timeline whose fourth step (the
    long prompt's chunk) took 40 ms and served no stream."""
    rows = [
        {"batch": b, "tinyserve_bfloat16": 10.0 * b, "transformers_float32": 2.0 * b}
        for b in (1, 2, 8)
    ]
    rows.append({"workload": "long_context", "streams": 2, "long_prompt": 64, "budget": 16})
    timeline = {
        "step_end_s": [0.01, 0.02, 0.03, 0.07, 0.08, 0.09],
        "streams_with_tokens": [2, 2, 2, 0, 2, 2],
        "long_arrival_s": 0.025,
        "long_first_token_s": 0.08,
        "long_finished_s": 0.09,
        "control_step_end_s": [0.01, 0.02, 0.03, 0.04, 0.05, 0.06],
        "control_streams_with_tokens": [2] * 6,
    }
    return {"workload": "cpu", "commit": "abc1234", "rows": rows, "long_context_timeline": timeline}


def test_plot_series_from_a_result():
    from tinyserve.bench.plot import itl_series, throughput_series

    res = _synthetic_result()
    assert throughput_series(res) == {
        "tinyserve bfloat16": [(1, 10.0), (2, 20.0), (8, 80.0)],
        "transformers float32": [(1, 2.0), (2, 4.0), (8, 16.0)],
    }
    tl = res["long_context_timeline"]
    times, itl = itl_series(tl["step_end_s"], tl["streams_with_tokens"])
    assert times == [0.01, 0.02, 0.03, 0.08, 0.09]  # no token at 0.07: the gap spans two steps
    assert [round(x, 6) for x in itl] == [10.0, 10.0, 10.0, 50.0, 10.0]
    spec_rows = [  # spec: a curve per (k, forced acceptance); e2e decode rows: one curve
        {"batch": b, "k": k, "forced_accept": f, "out_tok_per_s": float(b + k + (f or 0))}
        for b in (1, 4)
        for k, f in ((0, None), (1, 0), (1, 1))
    ]
    assert sorted(throughput_series({"rows": spec_rows})) == [
        "MTP k=1, 0 accepted",
        "MTP k=1, 1 accepted",
        "plain decode",
    ]
    decode = [{"workload": "decode", "batch": b, "out_tok_per_s": 5.0 * b} for b in (1, 2)]
    decode.append({"workload": "latency", "seqs": 1, "out_tok_per_s": 9.0})  # no batch: skipped
    assert throughput_series({"rows": decode}) == {"tinyserve": [(1, 5.0), (2, 10.0)]}


def test_plots_write_pngs_from_a_synthetic_result(tmp_path):
    pytest.importorskip("matplotlib")
    from tinyserve.bench.plot import ITL_PNG, THROUGHPUT_PNG, plot_result

    paths = plot_result(_synthetic_result(), str(tmp_path / "img"))
    assert paths == [str(tmp_path / "img" / THROUGHPUT_PNG), str(tmp_path / "img" / ITL_PNG)]
    for path in paths:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # One batch size or no timeline: nothing to draw, nothing written.
    assert plot_result({"rows": [{"batch": 1, "tinyserve_float32": 1.0}]}, str(tmp_path)) == []


def test_plot_command_draws_a_saved_result(tmp_path):
    """`bench.py plot FILE`: the plots of a JSON written on another machine."""
    pytest.importorskip("matplotlib")
    saved, empty = tmp_path / "cpu-abc1234.json", tmp_path / "pool.json"
    saved.write_text(json.dumps(_synthetic_result()))
    empty.write_text(json.dumps({"workload": "pool", "rows": [{"us_per_block": 1.0}]}))
    cmd = [sys.executable, "bench.py", "plot"]
    out = subprocess.run(
        [*cmd, str(saved), "--plot-dir", str(tmp_path / "img")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(os.listdir(tmp_path / "img")) == [
        "itl_during_prefill.png",
        "throughput_vs_batch.png",
    ]
    out = subprocess.run(
        [*cmd, str(empty), "--plot-dir", str(tmp_path / "none")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "nothing to plot" in out.stderr


def test_cpu_run_with_plot(tmp_path):
    """A real (small) cpu run: a row per batch size with tok/s per dtype, and --plot draws the
    throughput curve from them."""
    pytest.importorskip("matplotlib")
    img = tmp_path.parent / f"{tmp_path.name}-img"
    res = run_bench(
        tmp_path,
        "cpu",
        "--batches",
        "1",
        "2",
        "--new-tokens",
        "4",
        "--dtypes",
        "float32",
        "--no-compare-hf",
        "--plot",
        "--plot-dir",
        str(img),
    )
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    assert all(r["tinyserve_float32"] > 0 and r["new_tokens"] == 4 for r in res["rows"])
    assert res["ceilings"]["copy_GBps"] > 0
    assert os.listdir(img) == ["throughput_vs_batch.png"]


def test_help_runs_from_the_root():
    out = subprocess.run(
        [sys.executable, "bench.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for word in ("Workloads:", "cpu", "kernels", "prefix", "e2e", "serve", "spec", "pool"):
        assert word in out.stdout
    assert "--plot-dir" in out.stdout and "bench.py plot RESULT.json" in out.stdout


def test_shapes_import_from_bench_and_the_package():
    """The GPU tests import `from bench import SHAPES`; the package holds the same dict."""
    code = (
        "import bench, tinyserve.bench as b; assert bench.SHAPES is b.SHAPES; print(len(b.SHAPES))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 5


def test_the_checkout_does_not_shadow_the_pypi_kernels_package():
    """kernels/ has no __init__.py, so it is at most a namespace portion, which any regular
    package of that name found later on sys.path wins over. From the repository root, first
    on sys.path as `python bench.py` has it: the Triton kernels import as tinyserve.kernels.*,
    and where the PyPI `kernels` package (transformers imports it) is installed, `import
    kernels` finds that one."""
    import importlib.metadata

    code = (
        "import sys, os; assert os.path.abspath(sys.path[0] or os.curdir) == os.getcwd(); "
        "import tinyserve.kernels.gemv as g; import kernels; "
        "print(os.path.realpath(g.__file__)); print(getattr(kernels, '__file__', None))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    gemv, origin = out.stdout.split()
    assert gemv == os.path.join(os.path.realpath(ROOT), "kernels", "gemv.py")
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # not installed: the checkout's namespace portion is the only `kernels`
    assert "site-packages" in origin.split(os.sep), origin
    assert not origin.startswith(os.path.join(ROOT, "kernels", ""))
