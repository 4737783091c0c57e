"""Scheduler + block pool on plain lists: budgets, admission, preemption, invariants."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.scheduler import Scheduler
from tinyserve.core.sequence import Sequence, SequenceStatus
from tinyserve.core.state_pool import StatePool
from tinyserve.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(prompt_len: int, max_tokens: int = 8) -> Sequence:
    i = next(_ids)
    tokens = [i * 1000 + j for j in range(prompt_len)]  # distinct: no prefix sharing here
    return Sequence(i, str(i), 0, tokens, prompt_len, SamplingParams(), 0, max_tokens)


def run_step(sched: Scheduler) -> list[Sequence]:
    """What the engine does after a forward: advance KV, append a token, finish at max_tokens."""
    batch = sched.schedule()
    if batch is None:
        return []
    done = []
    sampled = [batch.samples(i) for i in range(len(batch.seqs))]
    for seq, num, s in zip(batch.seqs, batch.num_new_tokens, sampled):
        seq.num_kv_computed += num
        if s:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq, "length")
                done.append(seq)
    sched.check_invariants()
    return done


def test_decode_rows_first_then_chunked_prefill_under_budget():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=10)
    a = make_seq(6)
    sched.add(a)
    run_step(sched)  # a prefills 6 tokens, samples its first token
    b = make_seq(20)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 9]  # decode, then a chunk
    assert not batch.samples(1)  # non-final chunk samples nothing
    assert len(b.block_table) == 3  # KV only up to the chunk end (9 tokens / 4)


def test_max_num_seqs_limits_admission():
    pool = BlockPool(64, 4)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=100)
    for _ in range(3):
        sched.add(make_seq(3))
    batch = sched.schedule()
    assert len(batch.seqs) == 2 and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_first():
    pool = BlockPool(5, 4)  # 20 token slots: one 18-token sequence fits, two do not
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8, max_tokens=10), make_seq(8, max_tokens=10)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each
    assert pool.num_free_blocks == 1
    run_step(sched)  # a takes the last block for position 8; b needs one too: b is preempted
    assert b.status is SequenceStatus.WAITING and b.num_kv_computed == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    while sched.has_work:
        run_step(sched)
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert pool.num_free_blocks == pool.num_blocks


def test_sequence_preempts_itself_when_alone_and_stuck():
    pool = BlockPool(2, 4)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(4, max_tokens=3)
    sched.add(a)
    for _ in range(5):
        run_step(sched)
    assert a.is_finished and pool.num_free_blocks == 2


def test_state_slots_admit_and_free_with_the_sequence():
    """Hybrid models: a slot from admission to finish, abort or preemption; admission waits for
    one; each batch row carries its sequence's slot."""
    pool = BlockPool(5, 4)  # as above: b is preempted at the second step
    slots = StatePool(2)
    sched = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100, state_pool=slots)
    a, b, c = make_seq(8, max_tokens=10), make_seq(8, max_tokens=10), make_seq(2, max_tokens=2)
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and list(sched.waiting) == [c]  # no third slot
    assert batch.state_slots == [slots.slot_of(a.seq_id), slots.slot_of(b.seq_id)]
    for seq, num in zip(batch.seqs, batch.num_new_tokens):
        seq.num_kv_computed += num
        seq.token_ids.append(7)
    run_step(sched)  # b preempted: its slot back, and c may take it (but has no KV yet)
    assert b.status is SequenceStatus.WAITING and slots.slot_of(b.seq_id) is None
    sched.finish(c, "abort")
    assert slots.num_free_slots == 1 and slots.slot_of(a.seq_id) is not None
    while sched.has_work:
        run_step(sched)
    slots.check_invariants([])


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    num_slots=st.integers(0, 6),  # hybrid models' state slots (0: a dense model)
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(1, 30)), max_size=40
    ),
)
def test_random_ops_keep_invariants_and_free_everything(
    num_blocks, block_size, budget, max_num_seqs, num_slots, ops
):
    pool = BlockPool(num_blocks, block_size)
    slots = StatePool(num_slots) if num_slots else None
    sched = Scheduler(pool, max_num_seqs, budget, state_pool=slots)
    live: list[Sequence] = []
    capacity = num_blocks * block_size
    for op, arg in ops:
        if op == "add":
            prompt = min(arg, capacity - 4)
            if prompt <= 0:
                continue
            seq = make_seq(prompt, max_tokens=min(4, capacity - prompt))
            live.append(seq)
            sched.add(seq)
        elif op == "step":
            run_step(sched)
        elif live:
            seq = live[arg % len(live)]
            if not seq.is_finished:
                sched.finish(seq, "abort")
        sched.check_invariants()
    for _ in range(10_000):
        if not sched.has_work:
            break
        run_step(sched)
    assert not sched.has_work, "scheduler made no progress"
    assert pool.num_free_blocks == num_blocks
    if slots is not None:
        slots.check_invariants([])
    for seq in live:
        assert seq.is_finished
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.max_tokens
