"""The prefill lane: while others decode, a long prompt's big chunks run beside the steps
(prefill_lane.py). On the CPU its chunks run eagerly, so the scheduling, the KV accounting, the
commits and aborts are tested here; the GPU test compares the graph lane on its own stream."""

from __future__ import annotations

import random

import pytest
from overlap_helpers import VOCAB, make_llm, outputs

from tinyserve import SamplingParams
from tinyserve.config import EngineConfig, InvalidConfig


def lane_workload(seed: int = 0, long_len: int = 150):
    """Short prompts that decode for a while, and long ones that arrive with them."""
    rng = random.Random(seed)
    lens = (5, 3, 9, long_len, 4, long_len - 37)
    prompts = [[rng.randrange(8, VOCAB) for _ in range(n)] for n in lens]
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.8, seed=i, max_tokens=30 - 3 * i, ignore_eos=True
        )
        for i in range(len(lens))
    ]
    return prompts, params


@pytest.mark.parametrize(
    "overlap,caching,blocks",
    [(True, True, 256), (False, True, 256), (True, False, 256), (True, True, 48)],
)
def test_lane_gives_the_outputs_of_the_steps(model_dir, overlap, caching, blocks):
    """Greedy and seeded outputs are the same with the lane as without, with the overlapped
    loop on and off, the prefix cache on and off, and under KV pressure (48 blocks of 4: the
    lane waits for room, sequences are preempted); the lane really ran chunks."""
    prompts, params = lane_workload()
    kw = dict(
        max_num_batched_tokens=16,
        max_num_seqs=8,
        async_scheduling=overlap,
        enable_prefix_caching=caching,
        num_kv_blocks=blocks,
    )
    want = outputs(make_llm(model_dir, prefill_lane_tokens=0, **kw), prompts, params)
    llm = make_llm(model_dir, prefill_lane_tokens=32, **kw)
    assert outputs(llm, prompts, params) == want
    assert llm.engine.runner.lane.num_launched >= 3
    assert not llm.engine.scheduler.lane


def test_lane_runs_only_beside_decoding_rows_and_leaves_the_last_chunk(model_dir):
    """A long prompt alone is chunked into the steps as before; beside decoding sequences it
    takes the lane in chunks of up to 32, all but its last token (a step's row: it samples).
    Its sequence sits out of the steps while its chunks are in flight."""
    llm = make_llm(model_dir, prefill_lane_tokens=32, max_num_batched_tokens=16)
    engine, lane = llm.engine, llm.engine.runner.lane
    rng = random.Random(1)
    long = [rng.randrange(8, VOCAB) for _ in range(100)]
    engine.add_request("alone", long, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    assert lane.num_launched == 0
    endless = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("short", [9, 10, 11], endless)
    engine.step()
    engine.step()
    long2 = [rng.randrange(8, VOCAB) for _ in range(100)]
    engine.add_request("long", long2, SamplingParams(temperature=0, max_tokens=2))
    seq, launches = None, []
    for _ in range(3):
        engine.step()
        launches.append(len(engine.scheduler.lane_launches))
        seq = seq or engine.requests["long"].seqs[0]
        batch_seqs = engine._in_flight.batch.seqs if engine._in_flight else []
        assert not (seq.lane_tokens and seq in batch_seqs)
    # Admitted by a step (15 tokens beside the decode row), then lane chunks 15-47, 47-79 and
    # 79-99 (padded to 32), one launch a step (a launch costs host time: two in one step made
    # it a slowest step); the last token goes through a step.
    rows = []  # the long prompt's rows in the steps after the admission
    while "long" in engine.requests:
        engine.step()
        launches.append(len(engine.scheduler.lane_launches))
        batch = engine._in_flight.batch if engine._in_flight else None
        if batch is not None and seq in batch.seqs:
            rows.append(batch.num_new_tokens[batch.seqs.index(seq)])
    assert lane.num_launched == 3 and rows and max(rows) == 1
    assert max(launches) == 1
    engine.abort("short")
    engine.step()
    engine.check_invariants()


def test_abort_while_a_lane_chunk_is_in_flight_frees_its_blocks_once_done(model_dir):
    """An aborted sequence's blocks stay held until its lane chunks finish (the lane may still
    write them), then return to the pool; nothing leaks, nothing is freed twice."""
    llm = make_llm(model_dir, prefill_lane_tokens=32, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("short", [9, 10, 11], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    rng = random.Random(2)
    engine.add_request(
        "long",
        [rng.randrange(8, VOCAB) for _ in range(120)],
        SamplingParams(temperature=0, max_tokens=5),
    )
    while not engine.scheduler.lane:
        engine.step()
    seq = engine.requests["long"].seqs[0]
    held = list(seq.block_table)
    assert seq.lane_tokens and held
    engine.abort("long")
    engine.step()  # the abort, then the lane's poll: the chunks (eager) are done
    engine.check_invariants()
    assert seq.is_finished and not seq.lane_tokens and not seq.block_table
    engine.abort("short")
    engine.step()
    engine.step()
    engine.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_lane_chunks_enter_the_prefix_cache(model_dir):
    """Blocks the lane computed are committed when its chunk is done: the same prompt again
    hits all of them (the last token is always recomputed)."""
    llm = make_llm(model_dir, prefill_lane_tokens=32, max_num_batched_tokens=16)
    rng = random.Random(3)
    long = [rng.randrange(8, VOCAB) for _ in range(121)]
    short = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = llm.generate(
        [[9, 10, 11], long], [short, SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False
    )
    assert llm.engine.runner.lane.num_launched >= 2
    again = llm.generate([long], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert again[0].num_cached_tokens == 120
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids


@pytest.mark.parametrize("value", [-16, 24, 2.5, "64"])
def test_lane_tokens_must_be_whole_blocks(value):
    with pytest.raises(InvalidConfig, match="prefill_lane_tokens"):
        EngineConfig(prefill_lane_tokens=value, block_size=16, device="cpu")


def test_no_lane_where_no_prompt_could_take_it(model_dir):
    """The lane takes prompts longer than a chunk and a step's budget: with a max_model_len
    that leaves none (a chunk's positions, and the start-up capture's, must fit the block
    table) there is no lane; just above, a long prompt runs on it."""
    kw = dict(prefill_lane_tokens=16, max_num_batched_tokens=8)
    assert make_llm(model_dir, max_model_len=16, **kw).engine.runner.lane is None
    llm = make_llm(model_dir, max_model_len=64, **kw)
    rng = random.Random(6)
    prompts = [[9, 10, 11], [rng.randrange(8, VOCAB) for _ in range(50)]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 4)]
    want = outputs(make_llm(model_dir, max_model_len=64, max_num_batched_tokens=8), prompts, params)
    assert outputs(llm, prompts, params) == want
    assert llm.engine.runner.lane.num_launched == 3  # 7-23, 23-39, 39-49 (padded to 16)


def test_lane_is_off_by_default_on_the_cpu(model_dir):
    assert make_llm(model_dir).engine.runner.lane is None
    kw = dict(prefill_lane_tokens=32, max_num_batched_tokens=16)
    assert make_llm(model_dir, **kw).engine.runner.lane is not None


def test_chunks_in_flight_for_several_steps(model_dir, monkeypatch):
    """On the GPU a lane chunk spans many steps. With the lane's completions held back for 5
    polls: the outputs stay those of the steps; the short streams finish while the long
    prompt's two chunks are in flight, and a step with nothing to run then sleeps instead of
    spinning; with no stream left, the rest of the prompt goes through the steps."""
    import itertools

    import tinyserve.engine.llm_engine

    prompts, params = lane_workload(seed=5)
    prompts, params = prompts[:4], params[:4]  # three short ones that stop early, one long
    for p, n in zip(params, (3, 4, 2)):
        p.max_tokens = n
    kw = dict(max_num_batched_tokens=16, max_num_seqs=8)
    want = outputs(make_llm(model_dir, prefill_lane_tokens=0, **kw), prompts, params)
    llm = make_llm(model_dir, prefill_lane_tokens=32, **kw)
    lane, calls = llm.engine.runner.lane, itertools.count()
    real_poll = lane.poll
    monkeypatch.setattr(lane, "poll", lambda: real_poll() if next(calls) % 6 == 5 else 0)
    naps = []
    monkeypatch.setattr(tinyserve.engine.llm_engine.time, "sleep", naps.append)
    assert outputs(llm, prompts, params) == want
    assert (
        lane.num_launched == 2 and naps and set(naps) == {tinyserve.engine.llm_engine.LANE_IDLE_S}
    )


def test_lane_takes_prompts_longer_than_a_step_and_stays_inside_max_model_len(model_dir):
    """A prompt whose rest after admission fits one step's budget (23 tokens left, budget 40)
    stays in the steps even though it is longer than a chunk; and near max_model_len the lane
    stops where a padded chunk would pass the table (start 55 + 16 > 64): the last tokens go
    through the steps."""
    rng = random.Random(7)
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cases = [(40, 60, 0), (8, 60, 3)]  # (budget, prompt length, lane chunks)
    for budget, n, chunks in cases:
        kw = dict(max_model_len=64, max_num_batched_tokens=budget)
        prompts = [[9, 10, 11], [rng.randrange(8, VOCAB) for _ in range(n)]]
        want = outputs(make_llm(model_dir, **kw), prompts, [short, one])
        llm = make_llm(model_dir, prefill_lane_tokens=16, **kw)
        assert outputs(llm, prompts, [short, one]) == want
        assert llm.engine.runner.lane.num_launched == chunks, (budget, n)


def test_default_reserve_leaves_half_the_sms_to_small_models_and_3_8_to_large_ones():
    """A small model's decode step (hundreds of short kernels) needs SMs; a large one's streams
    its weights, which fewer SMs still pull, while its prefill needs every SM it can get
    (3/8 kept the large model's ITL and TTFT ratios under 2x on the H100: BENCHMARKS.md)."""
    from tinyserve.runner.prefill_lane import default_reserve_sms

    assert default_reserve_sms(132, weight_bytes=1_200_000_000) == 66  # qwen3-0.6b
    assert default_reserve_sms(132, weight_bytes=16_000_000_000) == 50  # llama-3.1-8b
    assert default_reserve_sms(78, weight_bytes=16_000_000_000) == 30
    # The H100's copy rate (where 3/8 was chosen) or less: the same count.
    assert default_reserve_sms(132, 16_000_000_000, copy_bytes_per_s=2.9e12) == 50
    assert default_reserve_sms(132, 16_000_000_000, copy_bytes_per_s=1.0e12) == 50


def test_default_reserve_grows_with_the_memory_rate_for_large_models():
    """The kept SMs must pull the decode's weight stream within the ITL budget of a control step
    that a faster memory makes shorter (on the H200, llama-3.1-8b needed 66 of 132 SMs kept:
    BENCHMARKS.md). Never more than half: small models' rule."""
    from tinyserve.runner.prefill_lane import default_reserve_sms

    assert default_reserve_sms(132, 16_000_000_000, copy_bytes_per_s=4.3e12) == 66
    assert default_reserve_sms(132, 16_000_000_000, copy_bytes_per_s=3.6e12) == 60
    assert default_reserve_sms(132, 16_000_000_000, copy_bytes_per_s=9e12) == 66
    assert default_reserve_sms(132, 1_200_000_000, copy_bytes_per_s=4.3e12) == 66
