"""Runtime state slots of hybrid models: one slot per running sequence, for every layer at once.

Slot i is row i of each Gated DeltaNet layer's state tensors (conv window + recurrent matrix),
which the runner allocates (layers/gated_deltanet.py `allocate_states`); the pool is the
bookkeeping only, plain Python. A sequence takes a slot on admission and gives it back on
finish, abort or preemption. A slot holds the state after its sequence's first
`num_kv_computed` tokens, so the runner passes has_initial_state = num_kv_computed > 0 and a
freshly taken slot needs no zeroing. Invariant: every slot is either free or owned by exactly
one sequence.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self.owners: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.num_slots

    def can_allocate(self, num: int = 1) -> bool:
        return num <= len(self.free_slots)

    def allocate(self, seq_id: int) -> int:
        """The slot of a sequence being admitted; the caller checks `can_allocate` first."""
        assert self.free_slots, "state pool full: the caller must check can_allocate first"
        assert seq_id not in self.owners, f"sequence {seq_id} already holds a state slot"
        slot = self.free_slots.pop()
        self.owners[seq_id] = slot
        return slot

    def slot_of(self, seq_id: int) -> int | None:
        return self.owners.get(seq_id)

    def free(self, seq_id: int) -> None:
        """Gives a finished, aborted or preempted sequence's slot back."""
        slot = self.owners.pop(seq_id, None)
        assert slot is not None, f"sequence {seq_id} holds no state slot (double free?)"
        self.free_slots.append(slot)

    def may_free(self, seq_id: int) -> None:
        """free(seq_id) if it holds a slot (an abort may come before admission)."""
        if seq_id in self.owners:
            self.free(seq_id)

    def check_invariants(self, live_seq_ids: list[int] | None = None) -> None:
        """Every slot free or owned by one sequence; with `live_seq_ids`, exactly those
        sequences own slots (after all requests end: pass [] and every slot is free)."""
        free = set(self.free_slots)
        assert len(free) == len(self.free_slots), "a slot freed twice"
        owned = list(self.owners.values())
        assert len(set(owned)) == len(owned), "a slot owned by two sequences"
        assert not free & set(owned), "an owned slot is also free"
        assert free | set(owned) == set(range(self.num_slots)), "a slot leaked"
        if live_seq_ids is not None:
            assert set(self.owners) == set(live_seq_ids), "slot owners != live sequences"
