"""Qwen3.5 (hybrid) through the engine: `LLM` / `LLMEngine` / `AsyncEngine` on tiny random
checkpoints written by transformers (fp32, CPU), greedy tokens identical to transformers'
`generate` for mixed-length prompts under chunk budgets of 16 / 64 / unlimited tokens, KV
pressure that preempts, n-gram speculation (drafts accepted and rejected), the overlapped loop
and the decode-graph path (replayed eagerly); the scheduler's and the state pool's invariants
after every step; what hybrid models refuse or turn off
(prefix caching with state checkpoints: tests/test_qwen3_5_prefix.py).
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from qwen3_5_helpers import eager_decode_graphs, hf_greedy, make_checkpoint

from tinyserve import LLM, AsyncEngine, SamplingParams
from tinyserve.model.config import UnsupportedModel

pytest.importorskip("transformers")

BASE_KW = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
# DeltaNet first and last (two patterns, one with the published 3:1 period), and a 12-token
# vocabulary whose greedy outputs repeat n-grams (n-gram drafts come, some are accepted).
CHECKPOINTS = {"lin_first_last": 0, "published_tied": 2, "small_vocab": 5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, prompts, transformers' greedy continuation of each)."""
    out = {}
    for variant, seed in CHECKPOINTS.items():
        path = tmp_path_factory.mktemp(variant)
        hf = make_checkpoint(path, variant, seed)
        vocab = hf.config.vocab_size
        rng = random.Random(100 + seed)
        lengths, max_new = ((1, 6, 13, 21, 9), 16) if vocab < 20 else ((1, 9, 23, 40), 6)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        want = [hf_greedy(hf, p, max_new)[len(p) :] for p in prompts]
        out[variant] = (str(path), prompts, want)
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], list]:
    """Step the engine to the end, checking the invariants (KV blocks, state slots) after every
    step; returns each prompt's tokens and its (drafted, accepted) counts."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(max_new))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    counts = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.outputs[0].token_ids
            counts[delta.request_id] = (delta.num_draft_tokens, delta.num_accepted_tokens)
        engine.check_invariants()
    pool = engine.scheduler.state_pool
    assert pool.num_free_slots == pool.num_slots  # every slot back
    return [tokens[str(i)] for i in range(len(prompts))], [counts[str(i)] for i in tokens]


@pytest.mark.parametrize("variant", ["lin_first_last", "published_tied"])
@pytest.mark.parametrize("budget", [16, 64, None])
def test_greedy_matches_generate(checkpoints, variant, budget):
    path, prompts, want = checkpoints[variant]
    llm = LLM(path, **BASE_KW, max_num_batched_tokens=budget)
    assert llm.engine.is_hybrid and len(llm.engine.runner.attn_layers) == 1
    assert run(llm, prompts, len(want[0]))[0] == want


def test_preemption_recomputes_the_state(checkpoints):
    """20 blocks of 4 tokens for prompts of up to 40 + 6: sequences are preempted (their slots
    freed) and re-admitted with their state recomputed from their tokens."""
    path, prompts, want = checkpoints["lin_first_last"]
    llm = LLM(path, **BASE_KW | dict(num_kv_blocks=20), max_num_batched_tokens=16)
    assert run(llm, prompts, len(want[0]))[0] == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_state_slots_bound_admission(checkpoints):
    """Two slots (max_num_seqs 2): the others wait for a finished sequence's slot."""
    path, prompts, want = checkpoints["published_tied"]
    llm = LLM(path, **BASE_KW, max_num_seqs=2, max_num_batched_tokens=16)
    assert llm.engine.scheduler.state_pool.num_slots == 2
    assert run(llm, prompts, len(want[0]))[0] == want


@pytest.mark.parametrize("budget", [16, None])
def test_ngram_speculation(checkpoints, budget):
    """Verify steps keep the state after each token and commit the last accepted one's (rows
    beside prompt chunks and rows without drafts too): drafts accepted and rejected, tokens
    as transformers'."""
    path, prompts, want = checkpoints["small_vocab"]
    llm = LLM(
        path,
        **BASE_KW,
        max_num_batched_tokens=budget,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    tokens, counts = run(llm, prompts, len(want[0]))
    assert tokens == want
    drafted, accepted = map(sum, zip(*counts))
    assert 0 < accepted < drafted, counts
    assert any(0 < a for _, a in counts)


def test_overlapped_loop(checkpoints):
    """The overlapped loop (the GPU default): a step's inputs come from the step in flight."""
    path, prompts, want = checkpoints["lin_first_last"]
    llm = LLM(path, **BASE_KW, max_num_batched_tokens=16, async_scheduling=True)
    assert run(llm, prompts, len(want[0]))[0] == want


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_graph_path(checkpoints, overlap):
    """The runner's decode-graph path on the CPU (DecodeGraphs with capture=False replays its
    static-buffer forward eagerly): state slots as graph inputs, padded rows on the scratch
    slot (4 rows pad to 4, 3 to 4: one padded row)."""
    path, prompts, want = checkpoints["published_tied"]
    llm = LLM(path, **BASE_KW, max_num_seqs=8, async_scheduling=overlap)
    eager_decode_graphs(llm)
    assert run(llm, prompts, len(want[0]))[0] == want
    assert llm.engine.runner.graphs.num_replays >= len(want[0]) - 1


def test_abort_frees_the_slot(checkpoints):
    path, prompts, _ = checkpoints["lin_first_last"]
    engine = LLM(path, **BASE_KW).engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(20))
    engine.step()
    engine.step()
    engine.abort("1")
    engine.abort("3")
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.state_pool.num_free_slots == engine.config.max_num_seqs


def test_what_hybrid_models_refuse_or_turn_off(checkpoints, caplog):
    path = checkpoints["small_vocab"][0]
    with pytest.raises(UnsupportedModel, match="no MTP layers"):  # tiny checkpoints ship none
        LLM(path, **BASE_KW, speculative_method="mtp", num_speculative_tokens=1)
    with caplog.at_level(logging.INFO):
        engine = LLM(path, **BASE_KW, prefill_lane_tokens=16).engine
    assert "prefill lane off" in caplog.text
    assert engine.runner.lane is None and engine.scheduler.lane_chunk == 0


def test_async_engine_streams(checkpoints):
    """The server's engine: concurrent streams of a hybrid model, one left early (aborted)."""
    path, prompts, want = checkpoints["lin_first_last"]
    engine = LLM(path, **BASE_KW).engine

    async def consume(ae, i, limit=None):
        tokens = []
        async for delta in ae.generate(str(i), prompts[i], greedy(len(want[0]))):
            tokens += delta.outputs[0].token_ids
            if len(tokens) == limit:
                break  # leaving early aborts the request
        return tokens

    async def go():
        ae = AsyncEngine(engine)
        limits = [None, 2, None, None]
        got = await asyncio.gather(*(consume(ae, i, n) for i, n in enumerate(limits)))
        for _ in range(100):  # the abort is processed by the next engine step
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await ae.close()
        return got

    got = asyncio.run(go())
    assert got[1] == want[1][:2] and [got[i] for i in (0, 2, 3)] == [want[i] for i in (0, 2, 3)]
    engine.check_invariants()
    assert engine.scheduler.state_pool.num_free_slots == engine.config.max_num_seqs
