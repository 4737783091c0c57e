"""Token-budget scheduler: continuous batching with chunked prefill and recompute preemption.

There are no prefill or decode phases (vLLM v1's idea): every step each sequence is given some
number of its uncomputed tokens under `max_num_batched_tokens`. Decode rows (1 token) go first,
then partial prefills resume, then waiting prompts are admitted while budget, `max_num_seqs` and KV
allow. KV is allocated chunk by chunk. When KV runs out, the newest running sequence is preempted
(its blocks freed, recomputed later). No CUDA here: this is unit-tested with plain lists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinyserve.block_pool import BlockPool
from tinyserve.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Row i produces a token: its chunk reaches the end of its known tokens."""
        seq = self.seqs[i]
        return seq.num_kv_computed + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        # NOTE: the engine rejects a sequence whose worst case cannot fit the whole pool, so
        # every waiting sequence can run once the others are done: no hang.
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        nums: list[int] = []
        scheduled: set[Sequence] = set()
        # 1) running sequences: decode rows first, then partial prefills, in admission order
        order = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num = min(seq.num_uncomputed, budget)
            while not self.pool.can_append(seq, num):
                # the newest sequence not already in this batch; at worst `seq` itself
                victim = next(s for s in reversed(self.running) if s not in scheduled)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.pool.may_append(seq, num)
            scheduled.add(seq)
            seqs.append(seq)
            nums.append(num)
            budget -= num
        # 2) admit waiting prompts (preempted ones sit at the front) while everything allows
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num = min(seq.num_uncomputed, budget)
            if not self.pool.can_append(seq, num):
                break
            self.waiting.popleft()
            self.pool.may_append(seq, num)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            nums.append(num)
            budget -= num
        return ScheduledBatch(seqs, nums) if seqs else None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.pool.free_seq(seq)
        seq.num_kv_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free a sequence that stopped (or was aborted), wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.pool.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_invariants(self) -> None:
        live = [*self.running, *self.waiting]
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
        assert len(self.running) <= self.max_num_seqs
        self.pool.check_invariants(live)
