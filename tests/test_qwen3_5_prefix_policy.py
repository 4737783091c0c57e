"""The hybrid prefix cache's policy (core/state_pool.py, core/scheduler.py): the DEBUG line per
admitted match (logger `tinyserve.prefix`: matched, where and why it was clamped, recomputed, the
checkpoint restored) and the branch-point counters, on a tiny random Qwen3.5 (fp32, CPU, greedy
tokens transformers'); checkpoint eviction in a CPU simulation of a shared system prompt beside
one-off prompts under a small state budget.
"""

from __future__ import annotations

import logging
import random

import pytest
import test_qwen3_5_prefix as base
from qwen3_5_helpers import hf_greedy
from test_qwen3_5_prefix import BASE_KW, MAX_NEW, hybrid_llm, serve

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.scheduler import Scheduler
from tinyserve.core.sequence import Sequence
from tinyserve.core.state_pool import HIT_CREDITS, StatePool
from tinyserve.sampling_params import SamplingParams

pytest.importorskip("transformers")
model = base.model  # the fixture: a tiny checkpoint, a system prompt and three questions


def match_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "tinyserve.prefix"]
    caplog.clear()
    return lines


def test_match_log_and_branch_counters(model, caplog):
    """16-token chunks: request 1 saves at 16 and 32 (no match); request 2 matches the 7
    system-prompt blocks, is clamped to 16 (no save ended at 28) and recomputes 12 tokens up to
    the branch point, saving it; request 3 resumes there (a branch hit)."""
    path, hf, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, max_num_batched_tokens=16)
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    got, lines = [], []
    for q in questions:
        got.append(serve(llm, system + q)[0])
        lines += match_lines(caplog)
    assert got == [hf_greedy(hf, system + q, MAX_NEW)[len(system + q) :] for q in questions]
    assert len(lines) == 3
    assert lines[0].endswith(": matched 0 of 39 tokens")
    assert lines[1].endswith(
        ": matched 28 of 39 tokens; clamped to 16 (no state after 28: no save ended there); "
        "recomputing 12 matched tokens; restored checkpoint 0"
    ), lines[1]
    assert ": matched 28 of 39 tokens; restored checkpoint" in lines[2]
    assert "clamped" not in lines[2]
    states = llm.engine.scheduler.state_pool
    assert (states.num_checkpoint_branch_saves, states.num_checkpoint_branch_hits) == (1, 1)
    assert states.num_checkpoint_hits == 2


def test_match_log_says_evicted(model, caplog):
    """A state budget of 1 and one sequence at a time (no idle slot to borrow while one runs):
    request 1's save at 32 evicts its save at 16, a one-off prompt's save evicts that; a prompt
    sharing request 1's first 33 tokens is clamped to 0, and the log says the state after 32
    was evicted."""
    path, hf, system, questions = model
    llm = hybrid_llm(
        path,
        **BASE_KW,
        max_num_batched_tokens=16,
        prefix_cache_state_budget=1,
        max_num_seqs=1,
    )
    first = system + questions[0]
    serve(llm, first)
    serve(llm, questions[1] + questions[2])  # 18 tokens: saves at 16
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    prompt = first[:33] + questions[1]
    got, cached = serve(llm, prompt)
    assert got == hf_greedy(hf, prompt, MAX_NEW)[len(prompt) :] and cached == 0
    (line,) = match_lines(caplog)
    assert line.endswith(
        ": matched 32 of 42 tokens; clamped to 0 (no state after 32: evicted); "
        "recomputing 32 matched tokens"
    ), line


def test_match_log_without_checkpoint_slots(model, caplog):
    path, _, system, questions = model
    llm = hybrid_llm(path, **BASE_KW, prefix_cache_state_budget=0)
    llm.engine.scheduler.state_pool.checkpoint_base = None  # (no idle slot borrowed either)
    serve(llm, system + questions[0])
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    serve(llm, system + questions[1])
    (line,) = match_lines(caplog)
    assert "clamped to 0 (no state after 28: no checkpoint slots (state budget 0, " in line


# -- eviction -----------------------------------------------------------------------------------


def shared_prompt_hit_rate(hit_credits: int, budget: int = 4, num: int = 200) -> float:
    """Requests one at a time, each resuming at a shared system prompt's checkpoint (block 0;
    recomputed and saved again as a branch point when evicted) and then saving 2-6 one-off
    checkpoints (chunk ends, decode saves); its hit rate under `budget` checkpoints."""
    rng = random.Random(0)
    pool = StatePool(1, budget, hit_credits=hit_credits)
    hits = 0
    for seq in range(num):
        pool.allocate(seq)
        if pool.restore_point([0]):
            pool.touch(0)
            hits += 1
        else:
            pool.attach(seq, pool.take_checkpoint(seq, 16, branch=True), 0)
        for i in range(rng.randint(2, 6)):
            block = 1 + seq * 8 + i
            pool.attach(seq, pool.take_checkpoint(seq, 32 + 16 * i), block)
        pool.free(seq)
        pool.check_invariants([])
    return hits / num


def chat_hit_rate(hit_credits: int, budget: int = 4, num: int = 200) -> float:
    """Six conversations taking turns at random: a turn resumes at its conversation's last
    save, then saves 1-2 (its tail: never hit again once the next turn saved its own)."""
    rng = random.Random(1)
    pool = StatePool(1, budget, hit_credits=hit_credits)
    last: dict[int, int] = {}
    hits = turns = 0
    for seq in range(num):
        conv = rng.randrange(6)
        pool.allocate(seq)
        if conv in last:
            turns += 1
            if pool.restore_point([last[conv]]):
                pool.touch(last[conv])
                hits += 1
        for i in range(rng.randint(1, 2)):
            last[conv] = 1 + seq * 8 + i
            pool.attach(seq, pool.take_checkpoint(seq, 16 * (i + 1)), last[conv])
        pool.free(seq)
        pool.check_invariants([])
    return hits / turns


def zipf_hit_rate(hit_credits: int, budget: int = 4, num: int = 300) -> float:
    """Three shared prompts drawn with Zipf weights (1, 1/2, 1/3): a request resumes at its
    prompt's checkpoint (or saves it as a branch point), then saves 1-4 one-off checkpoints."""
    rng = random.Random(2)
    pool = StatePool(1, budget, hit_credits=hit_credits)
    hits = 0
    for seq in range(num):
        pool.allocate(seq)
        prompt = rng.choices(range(3), weights=[1, 1 / 2, 1 / 3])[0]
        if pool.restore_point([prompt]):
            pool.touch(prompt)
            hits += 1
        elif (ck := pool.take_checkpoint(seq, 16, branch=True)) is not None:
            pool.attach(seq, ck, prompt)
        for i in range(rng.randint(1, 4)):
            if (ck := pool.take_checkpoint(seq, 32 + 16 * i)) is not None:
                pool.attach(seq, ck, 3 + seq * 8 + i)
        pool.free(seq)
        pool.check_invariants([])
    return hits / num


def test_shared_prompts_outlive_one_off_saves():
    """Three shared prompts beside one-off saves: one-off saves never evict a credited
    checkpoint, so the shared ones keep most of their hits under 4 and 8 checkpoints."""
    assert zipf_hit_rate(0) < 0.4 and zipf_hit_rate(HIT_CREDITS) > 0.65  # 0.34, 0.68
    assert zipf_hit_rate(0, 8) < 0.7 and zipf_hit_rate(HIT_CREDITS, 8) > 0.9  # 0.65, 0.95


def test_shared_branch_outlives_one_off_saves():
    """Plain LRU (no credits) evicts the shared prompt's checkpoint whenever a request saves 4 or
    more others; second chances for checkpoints hit twice keep it (the first hit, a chat's next
    turn, earns none: chats hit as often as under LRU)."""
    lru, credits = shared_prompt_hit_rate(0), shared_prompt_hit_rate(HIT_CREDITS)
    assert lru < 0.5 and credits > 0.9, (lru, credits)  # 0.42, 0.935
    assert chat_hit_rate(HIT_CREDITS) == chat_hit_rate(0)


def test_credits_bounded_and_spent():
    """Hits from the second on bank credits (at most `hit_credits`). A save that guesses at a
    later hit (a chunk end, a decode save) never evicts a credited checkpoint; a branch save's
    eviction scan spends a credit of each it passes over (a second chance)."""
    pool = StatePool(2, 3, hit_credits=2)
    pool.allocate(1)
    cks = [pool.take_checkpoint(1, 4 * (i + 1)) for i in range(3)]
    for ck, block in zip(cks, (10, 11, 12)):
        pool.attach(1, ck, block)
    for _ in range(5):
        pool.touch(10)  # hits 2-5 bank credits, at most 2
    pool.touch(11)  # one hit: no credit
    assert pool.credits == {cks[0]: 2} and pool.hits == {cks[0]: 5, cks[1]: 1}
    # LRU order 12, 10, 11: 12 goes first, then 11; 10 is passed over and keeps its credits
    assert pool.take_checkpoint(1, 16) == cks[2]
    pool.attach(1, cks[2], 13)
    assert pool.take_checkpoint(1, 20) == cks[1] and pool.credits == {cks[0]: 2}
    pool.attach(1, cks[1], 14)
    # LRU order 10, 13, 14: a branch save spends one of 10's credits and takes 13
    assert pool.take_checkpoint(1, 24, branch=True) == cks[2] and pool.credits == {cks[0]: 1}
    pool.attach(1, cks[2], 15)
    pool.check_invariants([1])
    # A decode tail others resumed from is not reused for the sequence's next decode save.
    tail = pool.take_checkpoint(1, 28, decode=True)  # evicts 14 (10 is credited)
    assert tail == cks[1]
    pool.attach(1, tail, 16)
    pool.allocate(2)
    pool.touch(16)  # sequence 2 resumes at sequence 1's decode save
    assert pool.take_checkpoint(1, 32, decode=True) == cks[2]  # 15: 10 credited, 16 resumed
    assert pool.checkpoint_of[16] == tail and pool.credits == {cks[0]: 1}
    pool.free(1)
    pool.free(2)
    pool.check_invariants([])


def test_decode_saves_spare_running_tails():
    """A decode save evicts no running sequence's tail (they would evict each other until every
    one was lost): with the rest credited it saves nothing. A chunk end may take one, and a
    branch point a credited checkpoint once its credits are spent."""
    pool = StatePool(3, 2, hit_credits=2)
    pool.allocate(1)
    pool.allocate(2)
    shared = pool.take_checkpoint(1, 16)
    pool.attach(1, shared, 10)
    pool.touch(10)
    pool.touch(10)  # a second hit: one credit
    tail = pool.take_checkpoint(2, 16, decode=True)
    pool.attach(2, tail, 20)
    assert pool.take_checkpoint(1, 32, decode=True) is None
    assert pool.take_checkpoint(1, 32) == tail
    pool.attach(1, tail, 11)
    assert pool.take_checkpoint(1, 48, branch=True) == tail  # 10 spends its credit first
    assert pool.take_checkpoint(2, 64, branch=True) == shared and not pool.credits
    pool.check_invariants([1, 2])


# -- idle runtime slots hold checkpoints (borrowed) ---------------------------------------------


def test_borrowed_slots_and_reclaim():
    """No checkpoint rows: saves borrow idle runtime slots (id = slot - checkpoint_base, the
    runner's row is the slot's); admissions reclaim them, a ready one first (its node keeps
    why), then a pending one (marked for the scheduler to drop its save), and the checkpoint an
    admission restores last (it restores onto itself)."""
    pool = StatePool(3, 0, checkpoint_base=10)
    assert pool.allocate(1) == 0
    a = pool.take_checkpoint(1, 4)
    b = pool.take_checkpoint(1, 8, decode=True)
    assert (a, b) == (1 - 10, 2 - 10) and pool.borrowed == {1, 2}
    assert pool.take_checkpoint(1, 12) is None  # both pending, no slot left to borrow
    pool.attach(1, a, 5)
    pool.check_invariants([1], {5})
    assert pool.can_allocate(2) and pool.num_free_slots == 2  # (borrowed ones count)
    assert pool.allocate(2) == 1 and pool.why_no_checkpoint(5) == "reclaimed by a running sequence"
    assert pool.reclaimed == set() and pool.num_checkpoint_evictions == 1
    assert pool.allocate(3) == 2  # the pending decode save goes, its save must not run
    assert pool.reclaimed == {b} and 1 not in pool.pending and 1 not in pool.tails
    pool.check_invariants([1, 2, 3], {5})
    for seq in (1, 2, 3):
        pool.free(seq)
    pool.allocate(4)
    ck = pool.take_checkpoint(4, 4)
    pool.attach(4, ck, 6)
    pool.free(4)
    pool.allocate(5)
    pool.allocate(6)  # slots 0 and 1 (the free ones); ck's slot is left
    restored = pool.touch(6)
    assert pool.allocate(7, keep=restored) == restored + 10 and not pool.borrowed
    pool.check_invariants([5, 6, 7], {5, 6})
    assert StatePool(1, 0).why_no_checkpoint(5).startswith("no checkpoint slots")


def test_branch_saves_take_checkpoint_rows():
    """A branch point evicts a checkpoint row's ready checkpoint rather than borrow an idle
    runtime slot (the requests about to resume there are admitted into the idle slots and would
    reclaim it); other saves borrow first, and a branch save borrows when no row is ready."""
    pool = StatePool(3, 1, checkpoint_base=10)
    pool.allocate(1)
    old = pool.take_checkpoint(1, 4)
    pool.attach(1, old, 5)
    assert pool.take_checkpoint(1, 8) < 0  # an ordinary save borrows an idle slot
    branch = pool.take_checkpoint(1, 12, branch=True)
    assert branch == old and pool.why_no_checkpoint(5) == "evicted"
    assert pool.take_checkpoint(1, 16, branch=True) < 0  # the row is pending: borrow
    pool.check_invariants([1], {5})


def test_speculative_decode_saves_settle():
    """A speculative decode save stays pending until its step's accepted tokens are known:
    dropped, it frees its checkpoint and leaves the sequence's tail alone; kept, it replaces the
    previous decode save (the sequence keeps one), as a plain decode save does."""
    pool = StatePool(2, 3)
    pool.allocate(1)
    tail = pool.take_checkpoint(1, 8, decode=True)
    pool.attach(1, tail, 5)
    a = pool.take_checkpoint(1, 12, speculative=True)
    b = pool.take_checkpoint(1, 12, speculative=True)  # the same position, a step later
    pool.settle_speculative_save(1, 12, a, kept=False)
    assert a in pool.free_checkpoints and pool.tails[1] == (tail, 5) and tail in pool.ready
    pool.settle_speculative_save(1, 12, b, kept=True)
    assert tail in pool.free_checkpoints and pool.tails[1] == (b, -1)
    pool.settle_speculative_save(1, 12, a, kept=True)  # no longer pending (ids are reused)
    pool.attach(1, b, 6)
    assert pool.tails[1] == (b, 6) and pool.num_checkpoint_saves == 2
    pool.check_invariants([1], {5, 6})


def test_scheduler_drops_a_reclaimed_save():
    """One step: prompt a's chunk ends on a block (its save borrows the idle slot), then
    prompt b's admission reclaims that slot: the batch carries no save into it (the forward
    writes b's state there before the save would read a's)."""
    pool = BlockPool(16, 4)
    states = StatePool(2, 0, checkpoint_base=3)
    pool.states = states
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=16, state_pool=states)
    for i, n in enumerate((8, 5)):
        prompt = [100 * i + j for j in range(n)]
        sched.add(Sequence(i, str(i), 0, prompt, n, SamplingParams(), 0, 4))
    batch = sched.schedule()
    assert batch.num_new_tokens == [8, 5] and batch.state_slots == [0, 1]
    assert states.num_checkpoint_borrows == 1 and states.reclaimed == {1 - 3}
    assert batch.state_saves == []
    sched.check_invariants()
