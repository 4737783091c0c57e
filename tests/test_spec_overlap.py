"""The overlapped step loop with MTP: the next step takes its last token, drafts and
position shift from the step in flight on the device, with the synchronous loop's tokens
and drafts; aborts, stops and min_tokens requests land safely."""

from __future__ import annotations

import pytest
from spec_helpers import GREEDY, make_llm, prompts, reference_drafts, run, traced

from tinyserve import SamplingParams
from tinyserve.core.sequence import PLACEHOLDER


def check_mtp_drafts(llm, k: int) -> list[int]:
    """Compare each step's MTP drafts (read on the device side) with a from-scratch
    computation over the tokens that step confirmed, away from the length limits."""
    engine, real = llm.engine, llm.engine._post_process
    checked = [0]

    def post(step, deltas):
        seqs = [step.batch.seqs[i] for i in step.sampled]
        real(step, deltas)
        if not seqs:
            return  # a step of prompt chunks only: nothing sampled, nothing drafted
        for seq, drafts in zip(seqs, step.pending.drafts.tolist()):
            tokens = [t for t in seq.token_ids if t != PLACEHOLDER]
            if not seq.is_finished and len(tokens) + 3 * k < seq.num_prompt_tokens + seq.max_tokens:
                assert drafts == reference_drafts(engine.runner.model, tokens, k)
                checked[0] += 1

    engine._post_process = post
    return checked


@pytest.mark.parametrize(
    "k,caching,budget,blocks",
    [(1, True, 8192, None), (3, True, 16, None), (2, False, 64, None), (3, True, 64, 24)],
)
def test_overlapped_mtp_loop_equals_the_synchronous_one(
    mimo_dir, reference, k, caching, budget, blocks
):
    """Greedy MTP rows overlap: the next step takes its last token, its drafts and how far its
    positions move from the step in flight, on the device. Same tokens as without speculation
    and the same drafts as the synchronous loop (so the same acceptance), also under
    preemption."""
    kw = dict(
        speculative_method="mtp",
        num_speculative_tokens=k,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
        num_kv_blocks=blocks,
    )
    sync, ov = make_llm(mimo_dir, async_scheduling=False, **kw), make_llm(mimo_dir, **kw)
    t_sync, t_ov = traced(sync), traced(ov)
    checked = check_mtp_drafts(ov, k)
    assert run(sync, prompts()) == run(ov, prompts()) == reference
    assert checked[0] > 50
    assert t_ov["from_device"] > 10 and t_sync["from_device"] == 0
    for seq_id, want in t_sync["verifies"].items():
        got = t_ov["verifies"][seq_id]
        # The overlapped loop drafts fewer near max_tokens (a step in flight may still accept
        # some): compare up to the first verify that differs in size.
        same = next(
            (i for i, (g, w) in enumerate(zip(got, want)) if g[0] != w[0]), min(len(got), len(want))
        )
        assert same > 3 and got[:same] == want[:same], seq_id
    if blocks:
        assert ov.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("f", [1, 3])
def test_overlapped_loop_moves_positions_by_the_accepted_drafts(mimo_dir, f):
    """Forced acceptance: every step accepts f drafts, so every next step's positions, slots and
    context lengths move on the device by f. The tokens equal the synchronous loop's until
    the last few, where the overlapped loop drafts less."""
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=f)
    sync, ov = make_llm(mimo_dir, async_scheduling=False, **kw), make_llm(mimo_dir, **kw)
    t_ov, checked = traced(ov), check_mtp_drafts(ov, 3)
    want, got = run(sync, prompts()), run(ov, prompts())
    assert t_ov["from_device"] > 5 and checked[0] > 20
    for g, w in zip(got, want):
        assert len(g) == len(w) == GREEDY.max_tokens and g[:-8] == w[:-8]


def test_min_tokens_request_switches_the_mtp_loop_to_synchronous(mimo_dir, reference):
    """A min_tokens request (its stop mask reads the emitted count on the host) makes the
    engine drain the step in flight and run synchronously; greedy outputs do not change, and
    that request equals its output without speculation."""
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=20, min_tokens=5)
    extra = [5, 6, 7, 8, 9]
    want = run(make_llm(mimo_dir), [extra], sampled)[0]
    llm = make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=2)
    trace = traced(llm)
    engine = llm.engine
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    got: dict[str, list[int]] = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        if n == 6:
            engine.add_request("s", extra, sampled)
        for d in engine.step():  # a drain and a step in one call: two outputs per request
            for o in d.outputs:
                got.setdefault(d.request_id, []).extend(o.token_ids)
    assert trace["from_device"] > 3
    assert [got[str(i)] for i in range(len(reference))] == reference
    assert got["s"] == want
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("force", [None, 2])
def test_seeded_sampling_overlaps_with_mtp(mimo_dir, force):
    """Seeded sampled rows stay in the overlapped loop: their RNG counter moves on the device
    by the accepted drafts. Without forcing, the tokens equal plain decoding's (lossless);
    forced to accept 2 of 3 drafts, every step moves the counter and the tokens equal the
    synchronous loop's but for the last few (the overlapped loop drafts less there)."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30, ignore_eos=True)
    ps = prompts(4, seed=1)
    kw = dict(speculative_method="mtp", num_speculative_tokens=3, spec_force_accept=force)
    ov = make_llm(mimo_dir, **kw)
    trace = traced(ov)
    got = run(ov, ps, params)
    assert trace["from_device"] > 5
    want = run(make_llm(mimo_dir, async_scheduling=False, **kw), ps, params)
    if force is None:
        assert got == want == run(make_llm(mimo_dir), ps, params)
    else:
        assert all(g[:-8] == w[:-8] for g, w in zip(got, want))
        assert got != run(make_llm(mimo_dir), ps, params)  # the drafts' tokens, not plain ones


def test_abort_and_stop_while_an_mtp_step_is_in_flight(mimo_dir, reference):
    """An abort lands while the aborted row's verify step is in flight, and a stop token ends
    a row whose next step was already launched: the others' tokens never change, the stopped
    row ends at its stop token, and no block leaks."""
    stop = reference[2][9]
    llm = make_llm(mimo_dir, speculative_method="mtp", num_speculative_tokens=3)
    trace, engine = traced(llm), llm.engine
    stopping = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, stopping if i == 2 else GREEDY)
    got: dict[str, list[int]] = {}
    reasons = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        if n == 8:
            assert engine._in_flight is not None
            engine.abort("0")
        for d in engine.step():
            for o in d.outputs:
                got.setdefault(d.request_id, []).extend(o.token_ids)
                reasons[d.request_id] = o.finish_reason or reasons.get(d.request_id)
    assert trace["from_device"] > 5
    assert reasons["0"] == "abort" and reference[0][: len(got["0"])] == got["0"]
    cut = reference[2].index(stop) + 1
    assert got["2"] == reference[2][:cut] and reasons["2"] == "stop"
    assert all(got[str(i)] == reference[i] for i in (1, 3, 4, 5))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
