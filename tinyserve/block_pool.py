"""Paged KV blocks: a free list, reference counts, and per-sequence block tables.

The pool never touches tensors: a block id indexes the runner's cache tensors. A block is free
(refcount 0, in the free list) or referenced (refcount >= 1, not in the free list). Layers that do
not store paged KV simply ignore block ids, so nothing here assumes every layer is attention.
"""

from __future__ import annotations

from collections import deque

from tinyserve.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_ids) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num: int) -> list[int]:
        assert num <= len(self.free_ids), "caller must check can_append first"
        ids = [self.free_ids.popleft() for _ in range(num)]
        for i in ids:
            self.ref_counts[i] = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        for i in reversed(block_ids):  # tail blocks first: most recently used go last
            assert self.ref_counts[i] > 0, f"double free of block {i}"
            self.ref_counts[i] -= 1
            if self.ref_counts[i] == 0:
                self.free_ids.append(i)

    # -- per-sequence views -------------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs so that KV for `num_new_tokens` more tokens has slots."""
        needed = self.num_blocks_for(seq.num_kv_computed + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_ids)

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Allocate every block that `num_new_tokens` more tokens cross (n = k + 1 for spec)."""
        seq.block_table.extend(self.allocate(self.num_new_blocks(seq, num_new_tokens)))

    def free_seq(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []

    def check_invariants(self, seqs: list[Sequence] = ()) -> None:
        """Refcounts equal the number of live block tables holding each block; free list exact."""
        expected = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), "block listed twice"
            assert len(seq.block_table) >= self.num_blocks_for(seq.num_kv_computed)
            for i in seq.block_table:
                expected[i] += 1
        assert expected == self.ref_counts, "refcounts disagree with block tables"
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "block freed twice"
        assert free == {i for i, r in enumerate(self.ref_counts) if r == 0}
