"""State slots of hybrid models: runtime slots (one per running sequence) and checkpoint slots
(exact states kept for prefix hits), each for every Gated DeltaNet layer at once.

Runtime slot i is row i of each DeltaNet layer's state tensors (conv window + recurrent matrix),
which the runner allocates (layers/gated_deltanet.py `allocate_states`); checkpoint c is the row
the runner puts at its `checkpoint_base + c`. The pool is the bookkeeping only, plain Python.
A sequence takes a runtime slot on admission and gives it back on finish, abort or preemption. A
slot holds the state after its sequence's first `num_kv_computed` tokens, so the runner passes
has_initial_state = num_kv_computed > 0 and a freshly taken slot needs no zeroing.

A checkpoint is the state after a whole number of blocks: saved (a device copy enqueued after the
step that computed it) while *pending* on its sequence, then *ready* once the block it ends is
committed to the prefix trie, hung off that block's node. A prefix match resumes only after a
block with a ready checkpoint; every copy runs in stream order, so a ready checkpoint's copy is
always enqueued before any restore from it. Saves are taken at prompt chunk ends and, while a
sequence decodes, at the end of the block its prompt ends in, then every `decode_interval`
blocks (0: none) and at the last block end its `max_tokens` reach; a decoding sequence keeps
only its newest decode save (`tails`), where the next chat turn (prompt + answer + a new
message) resumes: at the answer's last block when it ran to `max_tokens`. A prompt that ends
mid-block needs no save there (nor a copy-on-write of its partial block): a match only ever
ends on a block the trie holds, full and committed, and the answer's first tokens complete that
block, whose end is saved. So the next turn resumes at or past where the prompt ended whatever
its length, short prompts included, unless the answer stopped inside that block (then at the
prompt's last chunk end).
Idle runtime slots hold checkpoints too (with `checkpoint_base`, the runner's row of checkpoint
0, known): a save with no free checkpoint row borrows a free runtime slot before it evicts a
ready checkpoint, and an admission with no free slot reclaims a borrowed one, evicting its
checkpoint (a ready one in eviction order; a pending one last, its save dropped if it is this
step's: the forward would write the slot before the save read it; a save of an earlier step
runs before, in stream order). A borrowed slot's checkpoint id is slot - checkpoint_base
(negative), so that the runner's row for it, checkpoint_base + id, is the slot's own. Nothing
here changes before an admission is sure to succeed, so a failed one has nothing to undo.
Invariant: every slot and every checkpoint is in exactly one state (runtime: free / owned /
borrowed; checkpoint: free / pending on one sequence / ready on one node).

Eviction (a full budget, or the checkpoint's trie node evicted): least recently used first, with
second chances for shared checkpoints. From its second hit on, each hit banks a credit (at most
HIT_CREDITS). Only a branch point's save, sure to be hit, evicts a credited checkpoint, and its
scan spends a credit to move one to the recent end instead; the other saves are guesses at a
later hit (chunk ends, decode saves) and pass credited ones over (`_new_checkpoint`). A shared
system prompt's branch point outlives a stream of one-off saves that push it out under plain LRU,
while a chat turn's tail, hit once by the next turn and dead after, earns nothing. A decode save
evicts no running sequence's tail either: with more chats running than rows, they would evict
each other round-robin until none was left at its sequence's end.
Hit rates in simulations with 4 / 8 checkpoints (tests/test_qwen3_5_prefix_policy.py): a shared
prompt beside 2-6 one-off saves a request: LRU 0.42 / 0.995, this 0.935 / 0.995; three shared
prompts (Zipf) beside 1-4: LRU 0.34 / 0.65, this 0.68 / 0.95 (0.58 / 0.77 when guesses spent
credits too); six chats: 0.38 / 0.58 both. Crediting first hits too did better on the shared
prompts but lost chats: the tails' credits kept dead checkpoints.
"""

from __future__ import annotations

from collections import OrderedDict

# Second chances a ready checkpoint may bank, one per hit from its second on (see the module).
HIT_CREDITS = 4


class StatePool:
    def __init__(
        self,
        num_slots: int,
        num_checkpoints: int = 0,
        decode_interval: int = 4,
        hit_credits: int = HIT_CREDITS,
        checkpoint_base: int | None = None,
    ) -> None:
        assert num_slots > 0 and num_checkpoints >= 0 and decode_interval >= 0
        self.num_slots = num_slots
        # A decoding sequence saves at block ends that are multiples of this many blocks (0:
        # never; EngineConfig.prefix_cache_decode_state_interval).
        self.decode_interval = decode_interval
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        self.owners: dict[int, int] = {}  # seq_id -> slot
        self.num_checkpoints = num_checkpoints
        self.free_checkpoints: list[int] = list(range(num_checkpoints - 1, -1, -1))
        # The runner's row of checkpoint 0, past every runtime slot (None: unknown, so no slot
        # is borrowed). Free runtime slots holding a checkpoint, and the borrowed ones an
        # admission reclaimed this step while their save was pending (see `allocate`).
        self.checkpoint_base = checkpoint_base
        self.borrowed: set[int] = set()
        self.reclaimed: set[int] = set()
        # seq_id -> [(position, checkpoint)]: saved, its block not committed yet
        self.pending: dict[int, list[tuple[int, int]]] = {}
        self.ready: OrderedDict[int, int] = OrderedDict()  # checkpoint -> block id, LRU first
        self.checkpoint_of: dict[int, int] = {}  # block id -> its ready checkpoint
        self.tails: dict[int, tuple[int, int]] = {}  # seq_id -> (last decode save, its block)
        # Eviction: hits of each ready checkpoint, and the second chances it has banked (at
        # most `hit_credits`; 0: plain LRU). Absent: none.
        self.hit_credits = hit_credits
        self.hits: dict[int, int] = {}
        self.credits: dict[int, int] = {}
        # Checkpoints (pending or ready) saved at a branch point: where a hit clamped short of
        # its matched blocks ended its recompute (the scheduler's `_admit`).
        self.branch_points: set[int] = set()
        # Cached blocks whose checkpoint went (block id -> why), for the match log's reasons.
        self.lost: dict[int, str] = {}
        self.num_checkpoint_saves = self.num_checkpoint_hits = self.num_checkpoint_evictions = 0
        self.num_checkpoint_branch_saves = self.num_checkpoint_branch_hits = 0
        self.num_checkpoint_borrows = 0  # saves into an idle runtime slot

    @property
    def num_free_slots(self) -> int:
        """Slots an admission can take: free ones and borrowed ones (reclaimed)."""
        return len(self.free_slots) + len(self.borrowed)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_slots / self.num_slots

    @property
    def can_checkpoint(self) -> bool:
        return bool(self.num_checkpoints) or self.checkpoint_base is not None

    def can_allocate(self, num: int = 1) -> bool:
        return num <= self.num_free_slots

    def allocate(self, seq_id: int, keep: int | None = None) -> int:
        """The slot of a sequence being admitted; the caller checks `can_allocate` first. A
        free one, else a borrowed one is reclaimed and its checkpoint goes: a ready one, in
        eviction order, `keep` (the one this admission restores: it then restores onto itself)
        last; else a pending one, whose save the scheduler drops if it is this step's."""
        assert self.num_free_slots, "state pool full: the caller must check can_allocate first"
        assert seq_id not in self.owners, f"sequence {seq_id} already holds a state slot"
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            ck = self._reclaim(keep)
            slot = ck + self.checkpoint_base
            self.borrowed.remove(slot)
        self.owners[seq_id] = slot
        return slot

    def _reclaim(self, keep: int | None) -> int:
        """A borrowed slot's checkpoint, given up for an admission (see `allocate`)."""
        self.num_checkpoint_evictions += 1
        borrowed = {ck for ck in self.ready if ck < 0 and ck != keep}
        if borrowed or (keep is not None and keep < 0):
            ck = self._victim(borrowed) if borrowed else keep
            self._unready(ck, "reclaimed by a running sequence")
            return ck
        # Every borrowed slot is pending then.
        seq_id, ck = next((i, c) for i, saves in self.pending.items() for _, c in saves if c < 0)
        self._drop_pending_one(seq_id, ck)
        if self.tails.get(seq_id, (None,))[0] == ck:
            del self.tails[seq_id]
        self.branch_points.discard(ck)
        self.reclaimed.add(ck)
        return ck

    def slot_of(self, seq_id: int) -> int | None:
        return self.owners.get(seq_id)

    def free(self, seq_id: int) -> None:
        """Gives a finished, aborted or preempted sequence's slot (and pending saves) back."""
        slot = self.owners.pop(seq_id, None)
        assert slot is not None, f"sequence {seq_id} holds no state slot (double free?)"
        self.free_slots.append(slot)
        self.drop_pending(seq_id)

    def _ck_of_slot(self, slot: int) -> int:
        """A borrowed runtime slot's checkpoint id: negative, so that the runner's row for it,
        checkpoint_base + id, is the slot's own row."""
        return slot - self.checkpoint_base

    def may_free(self, seq_id: int) -> None:
        """free(seq_id) if it holds a slot (an abort may come before admission)."""
        if seq_id in self.owners:
            self.free(seq_id)

    # -- checkpoints ------------------------------------------------------------------------------

    def take_checkpoint(
        self,
        seq_id: int,
        position: int,
        decode: bool = False,
        branch: bool = False,
        speculative: bool = False,
    ) -> int | None:
        """A checkpoint for `seq_id`'s state after `position` tokens (pending until `attach`),
        from `_new_checkpoint`; None when none may be taken. A decode save (`decode`) first
        takes the sequence's own previous decode save's back if that is still ready: a
        decoding sequence keeps one checkpoint at its newest block end (the next chat turn
        resumes there), not one per block, which would evict every prompt's. `branch`:
        saved at a branch point (counted, and so are the hits resumed from it). `speculative`:
        a decode save that may be dropped (`settle_speculative_save` replaces the tail)."""
        ck = None
        if decode:
            ck = self._take_back_tail(seq_id)
        elif not speculative:
            self.tails.pop(seq_id, None)
        if ck is None:
            ck = self._new_checkpoint(branch, tail=decode or speculative)
            if ck is None:
                return None
        self.pending.setdefault(seq_id, []).append((position, ck))
        if decode:
            self.tails[seq_id] = (ck, -1)  # its block: set by `attach`
        self.num_checkpoint_saves += 1
        if branch:
            self.branch_points.add(ck)
            self.num_checkpoint_branch_saves += 1
        return ck

    def _new_checkpoint(self, branch: bool, tail: bool = False) -> int | None:
        """A checkpoint to save into: a free row, else (a branch point) a row's evicted one,
        else an idle runtime slot borrowed, else a ready one evicted; None when none may go.
        A branch point is sure to be hit (by the prompts it was cut for): it may evict any
        ready checkpoint, in `_victim`'s order. Any other save is a guess at a later hit (a
        prompt chunk end; a decode save, `tail`): it evicts no checkpoint that has earned
        credits, which under state pressure the running sequences' saves would otherwise
        push out (a shared prompt's branch point), and a decode save no running sequence's
        tail: those would evict each other until every one was lost."""
        if self.free_checkpoints:
            return self.free_checkpoints.pop()
        if branch and (own := [c for c in self.ready if c >= 0]):
            # A branch point goes to a checkpoint row: the requests about to resume there
            # take the idle runtime slots as they are admitted, and would reclaim a borrowed one.
            return self._evict(own)
        if self.free_slots and self.checkpoint_base is not None:  # borrow an idle slot
            slot = self.free_slots.pop()
            self.borrowed.add(slot)
            self.num_checkpoint_borrows += 1
            return self._ck_of_slot(slot)
        if branch:
            return self._evict(self.ready) if self.ready else None
        live = {ck for ck, blk in self.tails.values() if self.ready.get(ck) == blk} if tail else ()
        candidates = [c for c in self.ready if c not in self.credits and c not in live]
        return self._evict(candidates) if candidates else None

    def _evict(self, candidates) -> int:
        ck = self._victim(candidates)
        self._unready(ck, "evicted")
        self.num_checkpoint_evictions += 1
        return ck

    def _victim(self, candidates) -> int:
        """The ready checkpoint among `candidates` (ready ones) to evict: the least recently
        used one without credits; one with credits spends one and goes to the most recent end
        instead (a second chance). Ends: each pass spends a credit, and credits come from hits."""
        ready, credits = self.ready, self.credits
        while True:
            ck = next(c for c in ready if c in candidates)
            left = credits.pop(ck, 0)
            if not left:
                return ck
            if left > 1:
                credits[ck] = left - 1
            ready.move_to_end(ck)

    def _unready(self, ck: int, why: str | None) -> None:
        """Ready checkpoint `ck` leaves its node (`why`: kept for the match log while the node
        stays cached); the caller reuses or frees it."""
        block_id = self.ready.pop(ck)
        del self.checkpoint_of[block_id]
        if why is not None:
            self.lost[block_id] = why
        self.branch_points.discard(ck)
        self.hits.pop(ck, None)
        self.credits.pop(ck, None)

    def _free_checkpoint(self, ck: int) -> None:
        self.branch_points.discard(ck)
        if ck < 0:  # a borrowed slot: free for admissions again
            slot = ck + self.checkpoint_base
            self.borrowed.remove(slot)
            self.free_slots.append(slot)
        else:
            self.free_checkpoints.append(ck)

    def pending_of(self, seq_id: int) -> list[tuple[int, int]]:
        return self.pending.get(seq_id, [])

    def attach(self, seq_id: int, ck: int, block_id: int) -> None:
        """Pending checkpoint `ck` ends committed trie block `block_id`: ready. A block that has
        one already (the same prefix saved twice) keeps it, and `ck` is freed."""
        self._drop_pending_one(seq_id, ck)
        if block_id in self.checkpoint_of:
            self._free_checkpoint(ck)
            return
        if self.tails.get(seq_id, (None,))[0] == ck:
            self.tails[seq_id] = (ck, block_id)
        self.ready[ck] = block_id
        self.checkpoint_of[block_id] = ck
        self.lost.pop(block_id, None)

    def _drop_pending_one(self, seq_id: int, ck: int) -> None:
        entries = self.pending[seq_id]
        entries.remove(next(e for e in entries if e[1] == ck))
        if not entries:
            del self.pending[seq_id]

    def settle_speculative_save(self, seq_id: int, position: int, ck: int, kept: bool) -> None:
        """A speculative row's decode save (`checkpoint_policy.may_save_speculative`), once its
        step's accepted tokens are known: `kept`, it becomes the sequence's newest decode save
        (the one before it goes, as `take_checkpoint(decode=True)` lets it); else it is freed
        (its token was a rejected draft's, or the position was reached by another step)."""
        if (position, ck) not in self.pending_of(seq_id):
            # Gone already: its sequence stopped, its slot was reclaimed, or another save of
            # the position became ready first (`attach` freed this one; `ck` may be reused).
            return
        if not kept:
            self._drop_pending_one(seq_id, ck)
            self._free_checkpoint(ck)
            self.num_checkpoint_saves -= 1
            return
        old = self._take_back_tail(seq_id)
        if old is not None:
            self._free_checkpoint(old)
        self.tails[seq_id] = (ck, -1)  # its block: set by `attach`

    def _take_back_tail(self, seq_id: int) -> int | None:
        """The sequence's previous decode save, taken off its node, if it is still ready and
        nobody resumed from it (one that others resumed from stays); the tail is forgotten."""
        tail = self.tails.pop(seq_id, None)
        if tail is None or self.ready.get(tail[0]) != tail[1] or tail[0] in self.hits:
            return None
        self._unready(tail[0], "replaced by a later decode save")
        return tail[0]

    def drop_pending(self, seq_id: int) -> None:
        """A sequence stopped before its saves' blocks were committed: free those (its last
        ready decode save stays, for whoever continues the conversation)."""
        self.tails.pop(seq_id, None)
        for _, ck in self.pending.pop(seq_id, ()):
            self._free_checkpoint(ck)

    def drop_block(self, block_id: int) -> None:
        """A trie node was evicted (its block is reused): its checkpoint goes with it."""
        ck = self.checkpoint_of.get(block_id)
        if ck is not None:
            self._unready(ck, None)
            self._free_checkpoint(ck)
            self.num_checkpoint_evictions += 1
        self.lost.pop(block_id, None)

    def restore_point(self, path: list[int]) -> int:
        """How many leading blocks of a matched chain to keep: up to the deepest one with a
        ready checkpoint (0: none, the sequence starts from an empty state)."""
        for k in range(len(path), 0, -1):
            if path[k - 1] in self.checkpoint_of:
                return k
        return 0

    def touch(self, block_id: int) -> int:
        """A hit restores the checkpoint after `block_id`: most recently used now."""
        ck = self.checkpoint_of[block_id]
        self.ready.move_to_end(ck)
        hits = self.hits[ck] = self.hits.get(ck, 0) + 1
        if hits > 1 and self.hit_credits:  # shared: a second hit and more bank a credit each
            self.credits[ck] = min(self.hit_credits, self.credits.get(ck, 0) + 1)
        self.num_checkpoint_hits += 1
        self.num_checkpoint_branch_hits += ck in self.branch_points
        return ck

    def why_no_checkpoint(self, block_id: int) -> str:
        """Why cached block `block_id` has no ready checkpoint (the match log's reason)."""
        if not self.can_checkpoint:
            return "no checkpoint slots (state budget 0, no idle slot borrowed)"
        return self.lost.get(block_id) or "no save ended there"

    def check_invariants(self, live_seq_ids: list[int] | None = None, cached_blocks=None) -> None:
        """Every slot free or owned by one sequence; with `live_seq_ids`, exactly those
        sequences own slots (after all requests end: pass [] and every slot is free). Every
        checkpoint free, pending on one live sequence or ready on one node (`cached_blocks`:
        the trie's blocks, where every ready checkpoint must hang)."""
        free = set(self.free_slots)
        assert len(free) == len(self.free_slots), "a slot freed twice"
        owned = list(self.owners.values())
        assert len(set(owned)) == len(owned), "a slot owned by two sequences"
        assert not free & set(owned), "an owned slot is also free"
        assert not (free | set(owned)) & self.borrowed, "a borrowed slot is also free or owned"
        assert free | set(owned) | self.borrowed == set(range(self.num_slots)), "a slot leaked"
        if live_seq_ids is not None:
            assert set(self.owners) == set(live_seq_ids), "slot owners != live sequences"
        assert set(self.pending) <= set(self.owners), "a stopped sequence keeps pending saves"
        assert set(self.tails) <= set(self.owners), "a stopped sequence keeps its tail"
        pending = [ck for entries in self.pending.values() for _, ck in entries]
        every = self.free_checkpoints + pending + list(self.ready)
        assert len(every) == len(set(every)), "a checkpoint in two places"
        borrowed = {self._ck_of_slot(s) for s in self.borrowed}
        assert set(every) == set(range(self.num_checkpoints)) | borrowed, "a checkpoint leaked"
        assert all(ck >= 0 for ck in self.free_checkpoints), "a borrowed slot on the free list"
        assert {b: c for c, b in self.ready.items()} == self.checkpoint_of, "node map drifted"
        assert self.branch_points <= set(pending) | set(self.ready), "a free branch point"
        assert set(self.credits) <= set(self.hits) <= set(self.ready), "hits of a non-ready"
        assert all(0 < c <= self.hit_credits for c in self.credits.values())
        assert not set(self.lost) & set(self.checkpoint_of), "a ready checkpoint marked lost"
        if cached_blocks is not None:
            assert all(b in cached_blocks for b in self.checkpoint_of), "checkpoint on no node"
            assert all(b in cached_blocks for b in self.lost), "a reason kept for no node"
