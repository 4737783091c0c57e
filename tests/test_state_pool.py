"""StatePool: one slot per running sequence of a hybrid model; allocation refused when full,
slots back on finish / abort / preemption, and check_invariants() catching leaks and doubles."""

from __future__ import annotations

import random

import pytest

from tinyserve.core.state_pool import StatePool


def test_allocate_until_full_then_refuse():
    pool = StatePool(3)
    slots = [pool.allocate(seq_id) for seq_id in (10, 11, 12)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free_slots == 0 and pool.usage == 1.0
    assert not pool.can_allocate()
    with pytest.raises(AssertionError, match="full"):
        pool.allocate(13)
    pool.check_invariants([10, 11, 12])


def test_free_returns_the_slot_for_reuse():
    pool = StatePool(2)
    a = pool.allocate(1)
    pool.allocate(2)
    pool.free(1)  # finished
    assert pool.slot_of(1) is None and pool.can_allocate()
    assert pool.allocate(3) == a  # the freed slot, now another sequence's
    pool.check_invariants([2, 3])
    pool.may_free(4)  # aborted before admission: nothing to give back
    pool.may_free(2)
    pool.free(3)
    pool.check_invariants([])
    assert pool.num_free_slots == 2 and pool.usage == 0.0


def test_double_allocation_and_double_free_are_bugs():
    pool = StatePool(2)
    pool.allocate(7)
    with pytest.raises(AssertionError, match="already"):
        pool.allocate(7)
    pool.free(7)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(7)


def test_check_invariants_catches_corruption():
    pool = StatePool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError, match="live"):
        pool.check_invariants([1, 2])  # sequence 2 runs without a slot
    pool.free_slots.append(pool.owners[1])  # a slot both free and owned
    with pytest.raises(AssertionError, match="also free"):
        pool.check_invariants()
    pool = StatePool(3)
    pool.owners[5] = pool.free_slots.pop()
    pool.free_slots.pop()  # dropped on the floor
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_random_admit_finish_preempt_sequence_keeps_invariants():
    """Admissions (when a slot is free), finishes, aborts and preemptions in random order:
    every step the owners are exactly the running sequences, no slot shared or lost."""
    rng = random.Random(0)
    pool = StatePool(5)
    running: list[int] = []
    next_id = 0
    for _ in range(500):
        if rng.random() < 0.5 and pool.can_allocate():
            pool.allocate(next_id)
            running.append(next_id)
            next_id += 1
        elif running:  # finish, abort or preempt: the same for the pool
            pool.free(running.pop(rng.randrange(len(running))))
        pool.check_invariants(running)
        assert len({pool.slot_of(s) for s in running}) == len(running)
    for seq_id in running:
        pool.free(seq_id)
    pool.check_invariants([])
