"""Prefix caching for hybrid models (Qwen3.5): a hit resumes only after a block with an exact
recurrent-state checkpoint. Greedy tokens identical to transformers' with the cache on (tiny
random checkpoints, fp32, CPU) for a shared system prompt with distinct questions and a second
chat turn reusing the first's prompt and answer, under chunk budgets of 16 / 64 / unlimited,
state budgets of 1 and many and decode save intervals of 0 / 1 / 5; `num_cached_tokens` equal to
the clamped hit; the branch point
saved by the first request that recomputes it; checkpoint slots' bookkeeping (StatePool unit
tests and a random walk over admit / step / abort / preempt with invariants after each op).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from qwen3_5_helpers import add_mtp_weights, eager_decode_graphs, hf_greedy, make_checkpoint

from tinyserve import LLM, SamplingParams
from tinyserve.cli import ENGINE_KEYS
from tinyserve.config import EngineConfig, InvalidConfig
from tinyserve.core.state_pool import StatePool

pytest.importorskip("transformers")

BS = 4
BASE_KW = dict(dtype="float32", device="cpu", block_size=BS, num_kv_blocks=96)
SYSTEM, SUFFIX, MAX_NEW = 30, 9, 6  # 7 shared full blocks (28 tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(path, transformers model, a system prompt, three questions)."""
    path = tmp_path_factory.mktemp("lin_first_last")
    hf = make_checkpoint(path, "lin_first_last", 0)
    rng = random.Random(7)
    system = [rng.randrange(hf.config.vocab_size) for _ in range(SYSTEM)]
    questions = [[rng.randrange(hf.config.vocab_size) for _ in range(SUFFIX)] for _ in range(3)]
    return str(path), hf, system, questions


@pytest.fixture(scope="module")
def mtp_path(model, tmp_path_factory):
    """`model`'s checkpoint with random MTP weights (lossless drafting: the same greedy tokens)."""
    path, hf, _, _ = model
    dst = tmp_path_factory.mktemp("lin_first_last_mtp")
    shutil.copytree(path, dst, dirs_exist_ok=True)
    add_mtp_weights(dst, hf.model, 1)
    return str(dst)


def hybrid_llm(path: str, **kwargs) -> LLM:
    """An LLM whose StatePool got the config's decode save interval and the runner's row of
    checkpoint 0 (so that idle runtime slots are borrowed) from the engine."""
    llm = LLM(path, **kwargs)
    engine = llm.engine
    states = engine.scheduler.state_pool
    assert states.decode_interval == engine.config.prefix_cache_decode_state_interval
    assert states.checkpoint_base == engine.runner.checkpoint_base
    return llm


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def assert_checkpoints_exact(llm: LLM, path: str, sequences: list[list[int]]) -> int:
    """Every ready checkpoint on the trie paths of `sequences` (prompt + output tokens) holds
    the state after its block's tokens: what a cache-off engine's slot holds after prefilling
    exactly those (conv windows and recurrent matrices of every DeltaNet layer). Returns how
    many were checked."""
    engine = llm.engine
    states, runner, bs = engine.scheduler.state_pool, engine.runner, engine.pool.block_size
    ref = LLM(path, **BASE_KW, enable_prefix_caching=False, max_num_seqs=1)
    seen = set()
    for tokens in sequences:
        kn = engine.pool.key_next_token
        extra = (lambda i, t=tokens: (t[(i + 1) * bs],)) if kn else None
        for b, block in enumerate(engine.pool.trie.match(tokens[: len(tokens) - kn], extra), 1):
            ck = states.checkpoint_of.get(block)
            if ck is None or ck in seen:
                continue
            seen.add(ck)
            ref.generate([tokens[: b * bs]], greedy(1), use_tqdm=False)  # its slot 0: after them
            row = runner.checkpoint_base + ck
            for (conv, ssm), (rconv, rssm) in zip(runner.states, ref.engine.runner.states):
                torch.testing.assert_close(conv[row], rconv[0], rtol=1e-3, atol=1e-4)
                torch.testing.assert_close(ssm[row], rssm[0], rtol=1e-3, atol=1e-4)
    return len(seen)


def serve(llm: LLM, prompt: list[int], max_new: int = MAX_NEW, *others) -> tuple[list[int], int]:
    """A request (and `others` admitted before it, together) run to the end, invariants after
    every step: its (tokens, cached tokens)."""
    engine = llm.engine
    for i, other in enumerate(others):
        engine.add_request(f"o{i}", other, greedy(max_new))
    engine.add_request("r", prompt, greedy(max_new))
    tokens, cached = [], None
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == "r":
                tokens += delta.outputs[0].token_ids
                cached = delta.num_cached_tokens
        engine.check_invariants()
    return tokens, cached


@pytest.mark.parametrize("budget,overlap", [(16, False), (16, True), (64, False), (None, False)])
def test_shared_system_prompt(model, budget, overlap):
    """Request 1 keeps states at its block-aligned chunk ends; request 2 matches the 7 shared
    blocks, resumes after the deepest with a checkpoint (block 4 with 16-token chunks, else
    none) and recomputes up to the branch point (28), saving a checkpoint there; request 3
    resumes at 28. Also in the overlapped loop (saves keyed a step late, when the tokens are)."""
    path, hf, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, max_num_batched_tokens=budget, async_scheduling=overlap)
    got = [serve(llm, system + q) for q in questions]
    want = [hf_greedy(hf, system + q, MAX_NEW)[SYSTEM + SUFFIX :] for q in questions]
    assert [t for t, _ in got] == want
    assert [c for _, c in got] == [0, 16 if budget == 16 else 0, 28]
    states = llm.engine.scheduler.state_pool
    assert states.num_checkpoint_hits == (2 if budget == 16 else 1)


@pytest.mark.parametrize(
    "budget,overlap,mtp",
    [(16, False, 0), (16, True, 0), (64, True, 0), (None, False, 0), (64, False, 2)],
)
def test_prompts_sharing_a_prefix_admitted_together(model, mtp_path, budget, overlap, mtp):
    """Five prompts sharing the system prompt, sent at once: the first one's chunks end at the
    deepest block end it shares with a waiting one (28; with MTP a block's key holds the token
    after it, still shared here), which saves a branch checkpoint there; the others wait for its
    blocks and resume at it, none recomputing the shared prefix (the ideal hit rate). Greedy
    tokens: transformers'."""
    path, hf, system, questions = model
    rng = random.Random(3)
    more = [[rng.randrange(hf.config.vocab_size) for _ in range(SUFFIX)] for _ in range(2)]
    prompts = [system + q for q in questions + more]
    kw = dict(BASE_KW, max_num_batched_tokens=budget, async_scheduling=overlap)
    if mtp:
        kw |= dict(speculative_method="mtp", num_speculative_tokens=mtp)
        path = mtp_path
    llm = hybrid_llm(path, **kw, enable_prefix_caching=True)
    got = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    llm.engine.check_invariants()
    want = [hf_greedy(hf, p, MAX_NEW)[len(p) :] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [0] + [28] * 4
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, got)]
    assert assert_checkpoints_exact(llm, path, full) >= 2
    states = llm.engine.scheduler.state_pool
    assert states.num_checkpoint_branch_saves == 1 and states.num_checkpoint_branch_hits == 4


@pytest.mark.parametrize("state_budget,max_num_seqs", [(2, 3), (None, 8)])
def test_branch_points_of_one_leader(model, state_budget, max_num_seqs):
    """Prompts sent together that branch from the first at two depths (after the system prompt's
    7 blocks, and a block later): its chunks end at both block ends (28, 32), each saved as a
    branch checkpoint into a checkpoint row even when the rows hold others (the idle runtime
    slots, 2 of 3, are what the followers' admissions take back), and each follower resumes at
    its own."""
    path, hf, system, questions = model
    a, b = system + questions[0], system + questions[1]
    c = system + questions[0][:4] + questions[2]  # 32 tokens shared with a
    kw = dict(prefix_cache_state_budget=state_budget, max_num_seqs=max_num_seqs)
    llm = hybrid_llm(path, **BASE_KW, **kw)
    for q in questions[1:]:  # checkpoints in both rows (a decode save each)
        serve(llm, q * 2, 12)
    got = llm.generate([a, b, c], greedy(MAX_NEW), use_tqdm=False)
    llm.engine.check_invariants()
    assert [o.outputs[0].token_ids for o in got] == [
        hf_greedy(hf, p, MAX_NEW)[len(p) :] for p in (a, b, c)
    ]
    assert [o.num_cached_tokens for o in got] == [0, 28, 32]
    full = [p + o.outputs[0].token_ids for p, o in zip((a, b, c), got)]
    assert assert_checkpoints_exact(llm, path, full) >= 2
    states = llm.engine.scheduler.state_pool
    assert states.num_checkpoint_branch_saves == 2 and states.num_checkpoint_branch_hits == 2


@pytest.mark.parametrize("state_budget", [1, None])
def test_second_chat_turn(model, state_budget):
    """Turn 2 = turn 1's prompt + answer + a new message: with a decode save every block it
    resumes at the last full block before the new message (a state budget of 1 is enough: one
    conversation). A 5-token prompt admitted first takes the slot turn 1 left (its final state),
    so turn 2's slot holds nothing but the restored checkpoint."""
    path, hf, system, questions = model
    llm = hybrid_llm(
        path,
        **BASE_KW,
        max_num_batched_tokens=16,
        prefix_cache_state_budget=state_budget,
        prefix_cache_decode_state_interval=1,
    )
    turn1 = system + questions[0]
    answer, _ = serve(llm, turn1, 12)
    turn2 = turn1 + answer + questions[1]
    got, cached = serve(llm, turn2, MAX_NEW, questions[2][:5])
    assert answer == hf_greedy(hf, turn1, 12)[len(turn1) :]
    assert got == hf_greedy(hf, turn2, MAX_NEW)[len(turn2) :]
    # Turn 1 computed KV for all but its last token: its last block end before that.
    assert cached == (len(turn1) + len(answer) - 1) // BS * BS == 48


@pytest.mark.parametrize(
    "k,overlap,force,graphs,interval",
    [
        (2, True, None, False, 1),
        (2, False, None, False, 1),
        (1, True, None, True, 1),
        (2, True, 2, True, 1),
        (3, False, 2, False, 1),
        (2, True, 2, True, 100),
        (1, False, None, False, 100),
    ],
)
def test_second_chat_turn_with_mtp(model, mtp_path, k, overlap, force, graphs, interval):
    """With MTP every decode row carries drafts, so a decode save position is reached by some
    step's accepted tokens, known after it: the scheduler saves it from the per-token state
    that holds it (the step it may be reached in, one or two), the engine keeps the save whose
    token was accepted. Turn 2 resumes at the last block turn 1 committed (with MTP a block's
    key holds the token after it), inside the answer; transformers' tokens. With acceptance
    forced (the drafts' states saved), the cache-off engine's tokens. `graphs`: decode and
    verify graphs replayed eagerly (the saves read the graph's positions). `interval` 100:
    the only decode saves are the prompt's block end and the last block max_tokens reaches."""
    path, hf, system, questions = model
    kw = dict(max_num_batched_tokens=16, prefix_cache_decode_state_interval=interval)
    kw |= dict(speculative_method="mtp", num_speculative_tokens=k, async_scheduling=overlap)
    kw |= dict(spec_force_accept=force)

    def chat(llm):
        turn1 = system + questions[0]
        answer, _ = serve(llm, turn1, 15)
        turn2 = turn1 + answer + questions[1]
        return turn1, answer, turn2, *serve(llm, turn2)

    llm = hybrid_llm(mtp_path, **BASE_KW, **kw)
    if graphs:
        eager_decode_graphs(llm, verify=True)
    turn1, answer, turn2, got, cached = chat(llm)
    if graphs:
        assert llm.engine.runner.verify_graphs.num_replays > 0
    if force is None:
        assert answer == hf_greedy(hf, turn1, 15)[len(turn1) :]
        assert got == hf_greedy(hf, turn2, MAX_NEW)[len(turn2) :]
    else:
        off = chat(LLM(mtp_path, **BASE_KW, **kw, enable_prefix_caching=False))
        assert (answer, got) == (off[1], off[3])
    # Turn 1 has KV for all but its last token, and its last block's key needs the token after.
    assert cached == (len(turn1) + len(answer) - 2) // BS * BS == 52


@pytest.mark.parametrize(
    "overlap,force,graphs,interval",
    [(True, None, False, 1), (True, 2, False, 1), (False, 1, False, 1), (True, 2, True, 100)],
)
def test_mtp_decode_saves_hold_the_exact_state(model, mtp_path, overlap, force, graphs, interval):
    """Every decode save an MTP engine keeps holds the state after its position's tokens:
    equal to the state a cache-off engine leaves after prefilling exactly those tokens (each
    row of every DeltaNet layer, conv window and recurrent matrix). With acceptance forced,
    most saves come from a draft's per-token state. `graphs`: through the verify graphs (replayed
    eagerly), whose positions the saves read; one decode save a sequence (`interval`), in its
    first verify step, so that no later save replaces it."""
    path, hf, system, questions = model
    kw = dict(max_num_batched_tokens=16, prefix_cache_decode_state_interval=interval)
    kw |= dict(speculative_method="mtp", num_speculative_tokens=2, async_scheduling=overlap)
    llm = hybrid_llm(mtp_path, **BASE_KW, **kw, spec_force_accept=force)
    if graphs:
        eager_decode_graphs(llm, verify=True)
    full = []
    for q in questions:  # each sequence keeps its newest decode save
        answer, _ = serve(llm, system + q, 15)
        full.append(system + q + answer)
    checked = assert_checkpoints_exact(llm, mtp_path, full)
    assert checked >= 5  # the shared chunk ends (16, 32), then one decode save a sequence


@pytest.mark.parametrize(
    "prompt_len,chunk,num_answer,want",
    [
        (39, 64, 3, 40),  # one chunk ending mid-block (no save), 3 answered: 40 (KV to 41)
        (5, 64, 4, 8),  # a prompt shorter than a block: 8 (KV to 8)
        (40, 64, 9, 48),  # a block-aligned prompt: the last block end max_tokens reaches
        (41, 64, 10, 48),  # ... and one ending mid-block (the interval's next save is 60)
        (39, 64, 1, 0),  # the answer stopped inside the prompt's block: nothing to resume at
        (39, 16, 1, 32),  # ... but the prompt's last chunk end
    ],
)
def test_next_turn_resumes_past_the_prompt(model, prompt_len, chunk, num_answer, want):
    """The default decode interval (4 blocks) with short answers: a prompt ending mid-block is
    not saved there, but the block it ends in is once the answer completes it, and so is the
    last block end the answer's `max_tokens` reach, off the interval's grid: turn 2 resumes
    at or past where turn 1's prompt ended, whatever its length, and at the last full block
    before the new message when turn 1 ran to `max_tokens`."""
    path, hf, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, max_num_batched_tokens=chunk)
    turn1 = (system + questions[0] + questions[1])[:prompt_len]
    answer, _ = serve(llm, turn1, num_answer)
    turn2 = turn1 + answer + questions[2]
    got, cached = serve(llm, turn2)
    assert got == hf_greedy(hf, turn2, MAX_NEW)[len(turn2) :]
    assert cached == want


@pytest.mark.parametrize("interval", [0, 1, 5])
def test_decode_state_interval(model, interval):
    """prefix_cache_decode_state_interval: decode saves at the end of the block the prompt ends
    in, then every `interval` blocks, and at the last block end max_tokens reaches (0: none).
    Turn 1 (39 prompt tokens in 16-token chunks, 12 answered) saves at its chunk end 32 and,
    decoding, at the block ends 40 / 44 / 48 the interval picks, 48 always (its last: KV for
    50 tokens); turn 2 resumes at the deepest. Tokens stay transformers' whatever the
    interval."""
    path, hf, system, questions = model
    llm = hybrid_llm(
        path,
        **BASE_KW,
        max_num_batched_tokens=16,
        prefix_cache_decode_state_interval=interval,
    )
    turn1 = system + questions[0]
    answer, _ = serve(llm, turn1, 12)
    turn2 = turn1 + answer + questions[1]
    got, cached = serve(llm, turn2)
    assert answer == hf_greedy(hf, turn1, 12)[len(turn1) :]
    assert got == hf_greedy(hf, turn2, MAX_NEW)[len(turn2) :]
    assert cached == {0: 32, 1: 48, 5: 48}[interval]


def test_decode_state_interval_config():
    assert EngineConfig(device="cpu").prefix_cache_decode_state_interval == 4
    assert EngineConfig(device="cpu", prefix_cache_decode_state_interval=0)  # no decode saves
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidConfig, match="prefix_cache_decode_state_interval"):
            EngineConfig(device="cpu", prefix_cache_decode_state_interval=bad)
    assert "prefix_cache_decode_state_interval" in ENGINE_KEYS


@pytest.mark.parametrize("borrow", [True, False])
def test_state_budget_0(model, borrow):
    """A state budget of 0: checkpoints only in idle runtime slots (borrowed). Request 2 is
    clamped to 0 and saves its branch point (28) in one; request 3 resumes there. Without
    borrowing (the runner's rows unknown to the pool) blocks still match, but no state is kept,
    so nothing is skipped."""
    path, hf, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, prefix_cache_state_budget=0)
    states = llm.engine.scheduler.state_pool
    if not borrow:
        states.checkpoint_base = None
    got = [serve(llm, system + q) for q in questions]
    assert [c for _, c in got] == ([0, 0, 28] if borrow else [0, 0, 0])
    assert [t for t, _ in got] == [
        hf_greedy(hf, system + q, MAX_NEW)[SYSTEM + SUFFIX :] for q in questions
    ]
    assert bool(states.borrowed) == borrow and states.num_checkpoints == 0


def test_concurrent_requests_and_evictions(model):
    """Many requests sharing the system prompt at once, a state budget of 2 and a KV pool small
    enough to evict trie blocks (with their checkpoints) and preempt: every hit clamps to a
    checkpoint still there, tokens stay transformers'."""
    path, hf, system, questions = model
    rng = random.Random(3)
    prompts = [system[: rng.randrange(8, SYSTEM)] + q for q in questions * 2]
    llm = hybrid_llm(
        path,
        **BASE_KW | dict(num_kv_blocks=24),
        max_num_batched_tokens=16,
        prefix_cache_state_budget=2,
    )
    engine = llm.engine
    for round_ in range(2):
        for i, p in enumerate(prompts):
            engine.add_request(f"{round_}-{i}", p, greedy(MAX_NEW))
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.outputs[0].token_ids)
            engine.check_invariants()
        for i, p in enumerate(prompts):
            assert tokens[f"{round_}-{i}"] == hf_greedy(hf, p, MAX_NEW)[len(p) :]
    states = engine.scheduler.state_pool
    assert states.num_checkpoint_hits > 0 and states.num_checkpoint_evictions > 0


# -- checkpoint bookkeeping ---------------------------------------------------------------------


def test_checkpoint_lifecycle():
    pool = StatePool(2, 2)
    pool.allocate(1)
    a = pool.take_checkpoint(1, 8)
    b = pool.take_checkpoint(1, 12)
    assert pool.take_checkpoint(1, 16) is None  # both pending: none to evict
    pool.attach(1, a, block_id=5)
    pool.attach(1, b, block_id=7)
    assert pool.restore_point([3, 5, 6]) == 2 and pool.restore_point([3, 4]) == 0
    pool.check_invariants([1], {5, 7})
    pool.touch(5)  # 7 is now the least recently used
    assert pool.take_checkpoint(1, 20) == b and 7 not in pool.checkpoint_of
    pool.drop_block(5)  # its trie node was evicted
    assert pool.restore_point([3, 5]) == 0
    pool.free(1)  # the pending save goes back
    pool.check_invariants([], {7})  # (7 stays cached: its checkpoint was evicted, not its node)
    assert len(pool.free_checkpoints) == 2


def test_duplicate_save_is_freed_and_decode_saves_rotate():
    pool = StatePool(2, 3)
    pool.allocate(1)
    pool.allocate(2)
    a = pool.take_checkpoint(1, 4)
    b = pool.take_checkpoint(2, 4)
    pool.attach(1, a, 9)
    pool.attach(2, b, 9)  # the same prefix, saved twice: one kept
    assert pool.checkpoint_of == {9: a} and b in pool.free_checkpoints
    c = pool.take_checkpoint(1, 8, decode=True)
    pool.attach(1, c, 10)
    assert pool.take_checkpoint(1, 12, decode=True) == c  # its own last decode save, reused
    assert 10 not in pool.checkpoint_of
    pool.check_invariants([1, 2], {9, 10})


@pytest.mark.parametrize("state_budget", [3, 0])
def test_random_ops_keep_invariants(model, state_budget):
    """admit / step / abort / preempt in random order, engine invariants (block pool, trie,
    runtime, borrowed and checkpoint slots) after each op; every request's tokens stay
    transformers'. Four sequences at most: idle runtime slots hold checkpoints (budget 0: only
    they do) and admissions reclaim them, ready or pending."""
    path, hf, system, questions = model
    rng = random.Random(11)
    llm = hybrid_llm(
        path,
        **BASE_KW | dict(num_kv_blocks=32),
        max_num_batched_tokens=16,
        prefix_cache_state_budget=state_budget,
        max_num_seqs=4,
    )
    engine, sched = llm.engine, llm.engine.scheduler
    states, reclaims = sched.state_pool, []  # per reclaim: was the checkpoint pending?
    reclaim = states._reclaim

    def counted(keep: int | None) -> int:
        ck = reclaim(keep)
        reclaims.append(ck in states.reclaimed)
        return ck

    states._reclaim = counted
    prompts = [
        system[: rng.randrange(4, SYSTEM)] + q[: rng.randrange(1, SUFFIX)] for q in questions
    ]
    prompts += [p[: rng.randrange(2, len(p))] for p in prompts]
    tokens: dict[str, list[int]] = {}
    aborted, n = set(), 0
    for _ in range(120):
        op = rng.random()
        if op < 0.25 and n < 16:
            engine.add_request(str(n), prompts[n % len(prompts)], greedy(MAX_NEW))
            tokens[str(n)] = []
            n += 1
        elif op < 0.32 and tokens:
            rid = rng.choice(sorted(tokens))
            engine.abort(rid)
            aborted.add(rid)
        elif op < 0.40 and sched.running and not sched.waiting:
            sched._batch = []
            sched._preempt(sched.running[-1])
        else:
            for delta in engine.step():
                tokens[delta.request_id] += delta.outputs[0].token_ids
        engine.check_invariants()
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.outputs[0].token_ids
        engine.check_invariants()
    for rid, got in tokens.items():
        p = prompts[int(rid) % len(prompts)]
        want = hf_greedy(hf, p, MAX_NEW)[len(p) :]
        assert got == (want[: len(got)] if rid in aborted else want), rid
    assert states.num_checkpoint_hits > 0 and states.num_checkpoint_borrows > 0
    assert True in reclaims and False in reclaims  # pending and ready borrowed slots taken


def test_ngram_speculation_with_hits(tmp_path):
    """Verify steps (rows with drafts save no state; rows without, after the accepted state is
    committed): a 12-token vocabulary repeats n-grams, so drafts are accepted and rejected."""
    hf = make_checkpoint(tmp_path, "small_vocab", 5)
    rng = random.Random(5)
    system = [rng.randrange(12) for _ in range(SYSTEM)]
    prompts = [system + [rng.randrange(12) for _ in range(SUFFIX)] for _ in range(3)]
    llm = hybrid_llm(
        str(tmp_path),
        **BASE_KW,
        max_num_batched_tokens=16,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    got = [serve(llm, p, 16) for p in prompts]
    assert [t for t, _ in got] == [hf_greedy(hf, p, 16)[len(p) :] for p in prompts]
    assert got[2][1] == 28


def test_checkpoint_metrics_on_the_server(model):
    """/metrics of a hybrid model: the checkpoint counters and the hit-rate gauge move with a hit
    (two prompts sharing the system prompt, the second resumes from a checkpoint and saves one at
    its branch point)."""
    import asyncio
    import re

    from test_server import serving

    path, _, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, max_num_batched_tokens=16)

    def series(text: str, name: str) -> float:
        return float(re.search(rf"^tinyserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))

    async def go():
        async with serving(llm.engine) as client:
            for q in questions[:2]:
                body = {"prompt": system + q, "max_tokens": 2, "ignore_eos": True}
                assert (await client.post("/v1/completions", json=body)).status == 200
            return await (await client.get("/metrics")).text()

    text = asyncio.run(go())
    assert series(text, "prefix_cache_state_checkpoint_saves_total") >= 1
    assert series(text, "prefix_cache_state_checkpoint_hits_total") == 1
    # The second prompt was clamped to 16 and saved at its branch point, 28.
    assert series(text, "prefix_cache_state_checkpoint_branch_saves_total") == 1
    assert series(text, "prefix_cache_state_checkpoint_branch_hits_total") == 0
    assert series(text, "prefix_cache_state_checkpoint_borrows_total") == 0  # rows to spare
    assert 0 < series(text, "prefix_cache_hit_rate") < 1
    assert series(text, "prefix_cache_state_checkpoints_ready") >= 1
