"""GPU end to end (make test-gpu), CUDA graphs: graphs on vs off give identical greedy
outputs, through every split count (long rows beside short ones, mixed graphs) and the
shared-prefix graphs."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from gpu_helpers import shape_dir, spy_split_counts, steps_without_sync  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402


def test_cuda_graphs_on_off_identical(tmp_path):
    """Batch 12, then one sequence whose context grows from 50 to 300 keys: its decode steps
    move through graphs of 1, 4, 8 and 16 splits (decode_num_splits; the last three in 32-key
    tiles, decode_tiling), as the eager steps do."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=4096)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=16, enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        splits = spy_split_counts(graphs) if graphs is not None else set()
        runs = [
            llm.generate(prompts, params, use_tqdm=False),
            llm.generate([prompts[3] * 2], long, use_tqdm=False),
        ]  # 50 + 250 tokens
        outs.append([o.outputs[0].token_ids for run in runs for o in run])
        assert eager or {1, 4, 8, 16} <= splits, splits
        del llm, graphs
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_long_row_beside_short_ones_takes_the_long_split_graphs(tmp_path):
    """12 short sequences decode beside one whose context passes 9,000 keys: a batch of 13
    (padded 16: 2 GPU-filling splits) whose longest context leaves a split over LONG_SPLIT_KEYS
    takes the LONG_SPLITS graphs (short rows in one split of them), with the eager steps'
    outputs."""
    from tinyserve.runner.graph_shapes import LONG_SPLITS

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=16384)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    prompts.append([(7 * j) % 5000 + 100 for j in range(9000)])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(
            path,
            load_format="dummy",
            seed=0,
            max_num_seqs=16,
            enforce_eager=eager,
            prefill_lane_tokens=0,
        )  # the same prompt kernels both ways
        graphs = llm.engine.runner.graphs
        splits = spy_split_counts(graphs) if graphs is not None else set()
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert eager or LONG_SPLITS in splits, splits
        del llm, graphs
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_mixed_graphs_read_a_long_decode_row_in_the_long_split_count(tmp_path):
    """A prompt is chunked (mixed graphs, no lane) while 12 short sequences decode beside one
    whose context passes 9,000 keys: those mixed steps take the LONG_SPLITS graphs, with the
    eager steps' tokens (float32: eager mixed steps attend decode rows with the prefill kernel)."""
    from tinyserve.runner.graph_shapes import LONG_SPLITS

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=16384)
    prompts = {f"s{i}": [(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)}
    prompts["long"] = [(7 * j) % 5000 + 100 for j in range(9000)]
    late = [(11 * j) % 4000 + 70 for j in range(400)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)  # past the late one

    def run(eager: bool) -> tuple[dict, set]:
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=16,
            num_kv_blocks=2048,
            max_num_batched_tokens=128,
            enforce_eager=eager,
            prefill_lane_tokens=0,
        )
        engine, used, sent = llm.engine, set(), []
        for g in engine.runner.mixed_graphs.values():
            for key, graph in list(g.graphs.items()):
                g.graphs[key] = SimpleNamespace(
                    replay=lambda key=key, graph=graph: (used.add(key[2][0]), graph.replay())
                )
        for rid, p in prompts.items():
            engine.add_request(rid, p, params if rid == "long" else short)

        def arrive(d):  # the late prompt, once the long row decodes
            if d.request_id == "long" and not sent:
                sent.append(engine.add_request("late", late, params))

        return steps_without_sync(engine, range(0), arrive), used

    graphed, used = run(eager=False)
    gc.collect()
    torch.cuda.empty_cache()
    assert LONG_SPLITS in used, used
    assert graphed == run(eager=True)[0]


def test_shared_prefix_graphs_match_eager(tmp_path):
    """24 prompts on two 300-token heads: decode steps replay the shared-prefix (cascade)
    graphs; fp32 keeps rounding out of the comparison with the eager row-by-row attention."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=4, max_position_embeddings=4096)
    heads = [[(7 * j + 100 * h) % 4000 + 50 for j in range(300)] for h in range(2)]
    prompts = [heads[i % 2] + [(31 * i + j) % 3000 + 60 for j in range(3 + i)] for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(
            path, load_format="dummy", dtype="float32", seed=0, max_num_seqs=32, enforce_eager=eager
        )
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if not eager:
            assert llm.engine.runner.graphs.num_shared_replays >= 10
        llm.engine.check_invariants()
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
