"""The overlapped step loop: step N+1 launches before step N's tokens reach the host, and every
output equals the one-step-at-a-time loop (tiny random Llama, CPU fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from overlap_helpers import VOCAB, make_llm, outputs, workload

from tinyserve import SamplingParams
from tinyserve.core.sequence import PLACEHOLDER


@pytest.mark.parametrize(
    "budget,blocks,caching", [(8192, 256, True), (16, 256, True), (64, 24, True), (32, 256, False)]
)
def test_same_outputs_as_the_synchronous_loop(model_dir, budget, blocks, caching):
    prompts, params = workload()
    kw = dict(max_num_batched_tokens=budget, num_kv_blocks=blocks, enable_prefix_caching=caching)
    sync = make_llm(model_dir, async_scheduling=False, **kw)
    ov = make_llm(model_dir, **kw)
    got, want = outputs(ov, prompts, params), outputs(sync, prompts, params)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):  # batch composition differs a little: float noise only
        assert (g[2] is None) == (w[2] is None)
        for a, b in zip(g[2] or [], w[2] or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    if blocks < 256:
        assert ov.engine.scheduler.num_preemptions > 0


def test_steps_really_overlap(model_dir):
    """Between steps the in-flight step's tokens are placeholders on the host, and the next
    step takes them from the device."""
    llm = make_llm(model_dir)
    engine = llm.engine
    engine.add_request("a", [9, 10, 11, 12], SamplingParams(temperature=0, max_tokens=8))
    launches = []
    real = engine.runner.launch

    def launch(batch, rows, prev=None, *rest):
        launches.append(prev is not None and any(PLACEHOLDER in s.token_ids for s in batch.seqs))
        return real(batch, rows, prev, *rest)

    engine.runner.launch = launch
    engine.step()  # prefill launched, nothing read back yet
    seq = engine.requests["a"].seqs[0]
    assert seq.token_ids[-1] == PLACEHOLDER and engine._in_flight is not None
    while engine.has_unfinished():
        engine.step()
    assert sum(launches) >= 6  # every decode step took its input from the device
    assert len(launches) == 8  # the prefill and 7 decode steps, no step past max_tokens
    assert PLACEHOLDER not in seq.token_ids and len(seq.output_ids) == 8


def test_abort_while_in_flight_and_penalties_switch_modes(model_dir):
    """An abort lands on a sequence whose step is in flight; a penalty request forces the
    synchronous loop for a while. Outputs of the others never change."""
    prompts, params = workload(1)
    ref = outputs(make_llm(model_dir, async_scheduling=False), prompts, params)
    llm = make_llm(model_dir)
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    got: dict[str, list[int]] = {}
    reasons = {}
    step = 0
    while engine.has_unfinished():
        if step == 3:
            engine.abort("0")
            engine.add_request(
                "pen",
                [20, 21, 22],
                SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.3),
            )
        for d in engine.step():
            for o in d.outputs:
                got.setdefault(d.request_id, []).extend(o.token_ids)
                if o.finish_reason:
                    reasons[d.request_id] = o.finish_reason
        step += 1
    engine.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert reasons["0"] == "abort" and reasons["pen"] == "length"
    for i in range(1, len(prompts)):
        assert got.get(str(i), []) == ref[i][0] and reasons[str(i)] == ref[i][1], i


@pytest.mark.parametrize("overlap", [True, False])
def test_shared_prefixes_computed_once_with_the_overlapped_loop(model_dir, overlap):
    """Followers arriving with their leader wait for its blocks even though the overlapped loop
    commits them a step late: the hit count is the theoretical one."""
    rng = random.Random(3)
    groups, per_group, sys_len = 3, 4, 32  # 8 blocks of 4 shared per group
    llm = make_llm(model_dir, async_scheduling=overlap)
    engine = llm.engine
    for g in range(groups):
        system = [rng.randrange(8, VOCAB) for _ in range(sys_len)]
        for r in range(per_group):
            ids = system + [rng.randrange(8, VOCAB) for _ in range(5)]
            engine.add_request(f"{g}-{r}", ids, SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished():
        engine.step()
    engine.check_invariants()
    assert engine.pool.trie.num_hit_tokens == groups * (per_group - 1) * sys_len


def test_packed_to_device_views():
    """A step's inputs (and the sampler's) travel in one copy: each view has its array's
    values, dtype and shape, and starts 16-byte aligned (Triton compiles a kernel variant per
    pointer alignment)."""
    import numpy as np

    from tinyserve.sample.transfer import packed_to_device

    tables = np.arange(15, dtype=np.int32).reshape(3, 5)
    floats = np.array([[0.5, -2.25], [1e-3, 7.0]], dtype=np.float32)
    arrays = [tables, [7], np.array([1, 2, 3], dtype=np.int32), [], [5, -1, 2**40], floats]
    views = packed_to_device(arrays, torch.device("cpu"))
    assert [v.dtype for v in views] == [
        torch.int32,
        torch.long,
        torch.int32,
        torch.long,
        torch.long,
        torch.float32,
    ]
    assert views[0].shape == (3, 5) and views[0].is_contiguous()
    for a, v in zip(arrays, views):
        assert v.tolist() == (a.tolist() if isinstance(a, np.ndarray) else a)
        assert v.data_ptr() % 16 == 0
    views[1][0] = 9  # views are separate: writing one leaves the others
    assert views[0].tolist() == tables.tolist() and views[4].tolist() == [5, -1, 2**40]


def test_sampling_rows_without_penalties_allocate_no_token_lists(model_dir):
    """Rows of sequences without penalties get shared empty sequences, not two new lists each:
    at 64 MTP rows a step the lists alone ran a gen-0 collection every step and a full one every
    ~100 steps, each a stall (BENCHMARKS.md). Penalty rows still carry the prompt and the
    output so far."""
    import gc

    llm = make_llm(model_dir)
    engine = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    penalty = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2)
    engine.add_request("plain", [9, 10, 11], plain)
    engine.add_request("penalty", [9, 10, 11], penalty)
    for _ in range(3):
        engine.step()
    light = engine._sampling_rows(engine.requests["plain"].seqs[0])[0]
    assert light.num_output_tokens > 0
    assert not gc.is_tracked(light.prompt_ids) and not gc.is_tracked(light.output_ids)
    full = engine._sampling_rows(engine.requests["penalty"].seqs[0])[0]
    assert list(full.prompt_ids) == [9, 10, 11] and len(full.output_ids) > 0
