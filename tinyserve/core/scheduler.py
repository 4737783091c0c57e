"""Token-budget scheduler: continuous batching, chunked prefill, prefix hits, preemption.

There are no prefill or decode phases (vLLM v1's idea): every step each sequence gets some of
its uncomputed tokens under `max_num_batched_tokens`, and KV is allocated for exactly those
tokens (chunk by chunk; `kv_token_limit`). Order within a step:
  1) decode rows (1 token each): running sequences keep decoding while a long prompt is chunked;
  2) short partial prefills, and long ones that have waited AGING_STEPS steps (aging);
  3) waiting prompts, admitted FIFO while budget, `max_num_seqs` and KV allow; admission first
     matches the prefix trie, as one transaction undone if the first chunk's KV does not fit;
     a prompt whose next block another sequence is prefilling right now waits to hit it;
  4) long partial prefills take what budget is left, so short prompts are not starved.
Under KV pressure the newest sequence still prefilling yields first (its committed blocks stay
cached), then the newest decoding one is preempted (recompute). No CUDA here.

The prefill lane (prefill_lane.py): while other sequences decode, the oldest prompt longer than
a lane chunk and a step's budget has its chunks of up to `lane_chunk` tokens run on the lane
instead of in the steps, one launched a step and at most `lane_depth` in flight; such a
sequence sits out of the steps until they finish (`lane_finished`), and its last token goes
through a step (it samples).

Speculative decoding: a decoding row carries its drafts (`seq.draft_ids`), so it schedules
1 + k tokens (fewer drafts if the budget is short), and a row that samples also reserves
`spec_lookahead` more KV slots (where the MTP head writes its chained drafts). The engine trims
what verification rejected after the step.

Hybrid models (a `state_pool`): a sequence also holds a state slot (core/state_pool.py) from
admission to finish, abort or preemption; admission waits for a free one (or reclaims one that a
checkpoint borrowed while idle: a save into it this step is dropped), and a preempted
sequence's state is recomputed from its tokens when it is admitted again. With prefix caching,
rows save their state at block ends (`state_saves`) and a prompt's chunks end at its branch
points (`seq.branch_points`) so that it saves there, as core/checkpoint_policy.py decides; a
prefix hit resumes after the deepest matched block with a checkpoint, copied into the new
sequence's slot before its first chunk (`state_restores`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.checkpoint_policy import cut_at_branch_point, may_checkpoint, shared_boundaries
from tinyserve.core.sequence import PLACEHOLDER, Sequence, SequenceStatus
from tinyserve.core.state_pool import StatePool

AGING_STEPS = 4  # a long prefill waits at most this many steps behind short prompts
# One DEBUG line per admitted prefix match: matched, where and why it was clamped, recomputed.
match_log = logging.getLogger("tinyserve.prefix")


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, this step (1 + drafts for a speculative row)
    state_slots: list[int] | None = None  # hybrid models: each sequence's state slot
    # Hybrid prefix caching: (checkpoint, slot) copied before the forward, and (slot, checkpoint)
    # after it (the state after the row's chunk, or the decode row's token).
    state_restores: list[tuple[int, int]] | None = None
    state_saves: list[tuple[int, int]] | None = None
    # Decode saves of rows whose positions only the device knows (drafts in flight), (row,
    # position, checkpoint), that the engine keeps only if a token accepted this step ends at
    # that position: rows carrying drafts save from the per-token state that may hold it
    # (`token_saves`), the others after their one token (a `state_saves` entry too).
    token_saves: list[tuple[int, int, int]] | None = None
    unsure_saves: list[tuple[int, int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Row i produces a token: its chunk reaches the end of its known tokens."""
        seq = self.seqs[i]
        return seq.num_kv_computed + self.num_new_tokens[i] >= seq.num_tokens


def needs_prompt_logprobs(seq: Sequence) -> bool:
    """Does `seq` still compute its prompt's logprobs (SamplingParams.prompt_logprobs)? Only
    completion 0 of such a request, until its first token. It takes no prefix hit (a cached
    block has no logits; it still commits its blocks for others) and no prefill-lane chunk (the
    lane writes KV only); a recompute after preemption past its first token needs none."""
    p = seq.params
    return p.prompt_logprobs is not None and seq.index == 0 and seq.num_output_tokens == 0


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_tokens: int | None = None,
        spec_lookahead: int = 0,
        max_model_len: int = 1 << 62,
        lane_chunk: int = 0,
        lane_depth: int = 2,
        lane_limit: int = 1 << 62,
        state_pool: StatePool | None = None,
    ) -> None:
        self.pool = pool
        self.state_pool = state_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A prefill with more tokens left than this is "long" and yields to short prompts.
        self.long_prefill_tokens = long_prefill_tokens or max(1, max_num_batched_tokens // 4)
        self.spec_lookahead = spec_lookahead
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_steps = 0
        self.num_preemptions = 0
        # lane_limit: positions the lane's block table holds (a padded chunk stays inside)
        self.lane_chunk, self.lane_depth, self.lane_limit = lane_chunk, lane_depth, lane_limit
        self.lane: deque[tuple[Sequence, int]] = deque()  # chunks in flight, oldest first
        self.lane_seq: Sequence | None = None  # the prompt the lane computes
        self.lane_launches: list[tuple[Sequence, int, int]] = []  # this step's (seq, start, num)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        # NOTE: the engine admits no sequence longer than the whole pool, so every waiting
        # sequence can run once the others are done: no hang.
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        self.num_steps += 1
        self._budget = self.max_num_batched_tokens
        self._batch: list[Sequence] = []
        self._nums: list[int] = []
        self._restores: list[tuple[int, int]] = []
        self._saves: list[tuple[int, int]] = []
        self._token_saves: list[tuple[int, int, int]] = []
        self._unsure_saves: list[tuple[int, int, int]] = []
        if self.state_pool is not None:
            self.state_pool.reclaimed.clear()
        # A sequence at its length limit is done; the overlapped loop learns it a step late.
        live = [s for s in self.running if not self._exhausted(s)]
        decoding = [s for s in live if s.num_uncomputed == 1]
        prefilling = [s for s in live if s.num_uncomputed > 1 and not s.lane_tokens]
        self.lane_launches = []
        if self.lane_chunk and decoding:
            self._feed_lane(prefilling)
            prefilling = [s for s in prefilling if not s.lane_tokens]
        # Admissions wait for blocks these will commit: prefills, and sequences whose last
        # step computed full blocks not committed yet (the overlapped loop commits a step late).
        bs = self.pool.block_size
        self._leaders = (
            [s for s in live if (s.num_committed_blocks + 1) * bs <= s.num_tokens]
            if self.pool.trie is not None and self.waiting
            else []
        )
        long = [s for s in prefilling if s.num_uncomputed > self.long_prefill_tokens]
        starved = [s for s in long if self.num_steps - s.last_scheduled_step > AGING_STEPS]
        # 1) decode rows, 2) short and starved prefills
        for seq in decoding + [s for s in prefilling if s not in long] + starved:
            self._schedule_running(seq)
        # 3) admit waiting prompts in order (preempted ones sit at the front)
        for seq in list(self.waiting):
            if self._budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self._admit(seq) is None:
                break  # no KV for its first chunk: later prompts wait too (FIFO)
        # 4) long prefills take the rest
        for seq in long:
            if seq not in starved:
                self._schedule_running(seq)
        if not self._batch:
            return None
        if self.state_pool is None:
            return ScheduledBatch(self._batch, self._nums)
        slots = [self.state_pool.owners[s.seq_id] for s in self._batch]
        reclaimed = self.state_pool.reclaimed  # (their slots run a sequence from this step on)
        saves = [(s, ck) for s, ck in self._saves if ck not in reclaimed]
        token_saves = [t for t in self._token_saves if t[2] not in reclaimed]
        unsure = [t for t in self._unsure_saves if t[2] not in reclaimed]
        return ScheduledBatch(
            self._batch, self._nums, slots, self._restores, saves, token_saves, unsure
        )

    def _feed_lane(self, prefilling: list[Sequence]) -> None:
        """Chunks for the prefill lane: the sequence on it keeps it up to its last token,
        else the oldest prompt with more than a chunk (and a step's budget) left takes it.
        KV is allocated chunk by chunk, as in the steps; without room the lane waits (and the
        steps chunk the prompt meanwhile)."""
        c, seq = self.lane_chunk, self.lane_seq
        if seq is None or seq.status is not SequenceStatus.RUNNING:  # done, aborted, preempted
            # Prompts that would take more than one step; one step's stall is what the steps
            # were sized for (max_num_batched_tokens).
            least = max(c, self.max_num_batched_tokens)
            can_lane = (s for s in prefilling if not needs_prompt_logprobs(s))  # KV only
            seq = self.lane_seq = next((s for s in can_lane if s.num_uncomputed > least), None)
        # One launch a step: a launch costs ~1 ms of host time (a 4096-token chunk's graph),
        # and two in one step would make it the slowest step of the prompt. A chunk runs for
        # tens of ms, so the second one in flight is launched in time a step later.
        if seq is not None and len(self.lane) < self.lane_depth:
            start = seq.num_kv_computed + seq.lane_tokens
            # All but the last token (its chunk samples: a step's, as a 1-token row). A
            # prompt's end chunked into the steps would cost each stream a whole chunk's
            # forward at the longest context (tens of ms a step).
            num = min(c, seq.num_tokens - 1 - start)
            if num < 1:
                self.lane_seq = None  # the lane is done with it
                return
            if start + c > min(self.max_model_len, self.lane_limit):  # padding too
                return
            if not self.pool.can_append(seq, seq.lane_tokens + num):
                return
            self.pool.may_append(seq, seq.lane_tokens + num)
            self.lane_launches.append((seq, start, num))
            self.lane.append((seq, num))
            seq.lane_tokens += num

    def lane_finished(self, num: int) -> None:
        """The `num` oldest lane chunks are done: their KV counts as computed and their full
        blocks enter the trie; a sequence finished meanwhile (aborted) frees its blocks now."""
        for _ in range(num):
            seq, c = self.lane.popleft()
            seq.lane_tokens -= c
            if seq.is_finished:
                if not seq.lane_tokens:
                    self.pool.free_seq(seq)
                continue
            seq.num_kv_computed += c
            self.pool.commit(seq)

    def _schedule_running(self, seq: Sequence) -> None:
        if (
            self._budget == 0
            or seq.status is not SequenceStatus.RUNNING
            or seq.last_scheduled_step == self.num_steps
        ):
            # Out of budget, or preempted earlier in this step, or scheduled already: a long
            # prefill preempted in 2) and admitted again in 3) is still on the list of 4).
            return
        uncomputed = seq.num_uncomputed
        shift = seq.num_unverified
        if uncomputed == 1 and not seq.draft_ids and not self.spec_lookahead and not shift:
            num, extra = 1, 0  # the common decode row
        else:
            num = cut_at_branch_point(seq, min(uncomputed + len(seq.draft_ids), self._budget))
            del seq.draft_ids[max(0, num - uncomputed) :]  # a short budget cuts drafts
            # Drafts the step in flight accepts move this step's slots up by as many.
            extra = shift + self._lookahead(seq, num + shift)
        while not self.pool.can_append(seq, num + extra):
            victim = self._pick_victim()
            self._preempt(victim)
            if victim is seq:
                # NOTE: a sequence alone can always grow (it fits the whole pool); anything
                # else would livelock here.
                assert self._batch or self.running, "a sequence outgrew the whole KV pool"
                return
        self._take(seq, num, extra)

    def _admit(self, seq: Sequence) -> bool | None:
        """Admitted (True), deferred a step (False), or no KV for its first chunk (None)."""
        if seq.token_ids[-1] == PLACEHOLDER:
            return False  # preempted while its step was in flight: wait for that step's tokens
        # Tentative (undone below unless admitted); none for a prompt that needs its logits.
        matched = branch = 0
        if not needs_prompt_logprobs(seq):
            matched = self.pool.match_prefix(seq)
            branch = self.pool.match_branch_tokens  # > matched: clamped to a checkpoint
        seq.branch_points = (branch,) if branch > matched else ()
        num = cut_at_branch_point(seq, min(seq.num_uncomputed, self._budget))
        extra = self._lookahead(seq, num)
        # A leader computing the block after the restore point, or after the deepest matched
        # block (its KV not committed yet), is waited for and hit, not recomputed alongside.
        in_flight = self._is_in_flight(seq, matched) or (
            branch > matched and self._is_in_flight(seq, branch)
        )
        no_slot = self.state_pool is not None and not self.state_pool.can_allocate()
        if in_flight or no_slot or not self.pool.can_append(seq, num + extra):
            self.pool.free_seq(seq)
            seq.num_kv_computed = 0
            return False if in_flight else None
        if shared := shared_boundaries(self, seq):  # (a cut chunk needs no more KV)
            seq.branch_points = tuple(sorted({*seq.branch_points, *shared}))
            num = cut_at_branch_point(seq, num)
            extra = self._lookahead(seq, num)
        self.waiting.remove(seq)
        ck = None
        if self.state_pool is not None:
            if matched:  # a hit: the checkpoint after the matched blocks into the slot
                ck = self.state_pool.touch(seq.block_table[-1])
                assert ck == self.pool.match_checkpoint
            slot = self.state_pool.allocate(seq.seq_id, keep=ck)
            if ck is not None:
                self._restores.append((ck, slot))
        if self.pool.trie is not None and match_log.isEnabledFor(logging.DEBUG):
            self._log_match(seq, matched, branch, ck)
        if seq.num_preemptions == 0:  # hit statistics describe first admissions only
            seq.num_cached_tokens = matched
            if self.pool.trie is not None:
                self.pool.trie.num_query_tokens += seq.num_prompt_tokens
                self.pool.trie.num_hit_tokens += matched
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._leaders.append(seq)  # later admissions of this step may wait for its blocks
        self._take(seq, num, extra)
        return True

    def _log_match(self, seq: Sequence, matched: int, branch: int, ck: int | None) -> None:
        why = ""
        if branch > matched:  # the deepest matched block has no ready checkpoint
            why = self.state_pool.why_no_checkpoint(self.pool.match_branch_block)
            why = f"; clamped to {matched} (no state after {branch}: {why})"
            why += f"; recomputing {branch - matched} matched tokens"
        match_log.debug(
            "seq %d (%s): matched %d of %d tokens%s%s",
            seq.seq_id,
            seq.request_id,
            branch,  # (= matched unless clamped to a checkpoint)
            seq.num_tokens,
            why,
            f"; restored checkpoint {ck}" if ck is not None else "",
        )

    def _is_in_flight(self, seq: Sequence, matched: int) -> bool:
        """Is a running sequence computing (or has it computed but not yet committed) the very
        block `seq` would compute next? Then `seq` waits for it to be committed and hits it,
        instead of computing the same KV twice."""
        if self.pool.trie is None or needs_prompt_logprobs(seq):
            return False  # (it would not hit that block: it needs its logits)
        end = matched + self.pool.block_size
        if end >= seq.num_tokens:
            return False  # the last token is never matched anyway
        bs = self.pool.block_size
        tokens, tail = seq.token_ids, seq.token_ids[end - bs : end]
        # The block itself first: leaders of other prefixes differ there, and comparing whole
        # prefixes (thousands of ids) per leader per waiting prompt costs ms a step.
        return any(
            (other.num_uncomputed > 1 or other.num_kv_computed >= end)
            and other.num_committed_blocks * bs < end <= other.num_tokens
            and other.token_ids[end - bs : end] == tail
            and other.cache_salt == seq.cache_salt
            and other.mm_spans == seq.mm_spans
            and other.token_ids[:end] == tokens[:end]
            for other in self._leaders
        )

    def _exhausted(self, seq: Sequence) -> bool:
        return seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len

    def _lookahead(self, seq: Sequence, num: int) -> int:
        """Extra KV slots of a row that samples (the MTP chain's), never past the position
        table: a chain step beyond them writes to the scratch slot instead."""
        if num < seq.num_uncomputed or not self.spec_lookahead:
            return 0  # a non-final prefill chunk owns KV up to its chunk end only
        room = self.max_model_len - (seq.num_kv_computed + num)
        return max(0, min(self.spec_lookahead, room))

    def _take(self, seq: Sequence, num: int, extra: int = 0) -> None:
        """Schedule `num` tokens of `seq` (+ `extra` KV slots), with the state saves the
        checkpoint policy wants after them."""
        self.pool.may_append(seq, num + extra)
        may_checkpoint(self, seq, num)
        seq.last_scheduled_step = self.num_steps
        self._batch.append(seq)
        self._nums.append(num)
        self._budget -= num

    def _pick_victim(self) -> Sequence:
        """Newest unscheduled sequence that is still prefilling, else the newest unscheduled."""
        candidates = [
            s for s in reversed(self.running) if s not in self._batch and not s.lane_tokens
        ]
        prefilling = [s for s in candidates if s.num_uncomputed > 1]
        return (prefilling or candidates)[0]

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV (committed blocks stay cached), requeue first."""
        self.running.remove(seq)
        self.pool.free_seq(seq)
        if self.state_pool is not None:  # its state is recomputed on re-admission
            self.state_pool.free(seq.seq_id)
        seq.num_kv_computed = 0
        seq.draft_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free a sequence that stopped (or was aborted), wherever it is."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if not seq.lane_tokens:  # else the lane may still write its blocks: `lane_finished`
            self.pool.free_seq(seq)
        if self.state_pool is not None:  # (hybrid models have no lane)
            self.state_pool.may_free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def check_invariants(self) -> None:
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in self.waiting)
        assert len(self.running) <= self.max_num_seqs
        finished = {s for s, _ in self.lane if s.is_finished}  # blocks held till the lane ends
        self.pool.check_invariants([*self.running, *self.waiting, *finished])
        if self.state_pool is not None:  # a slot for each running sequence, no other
            cached = self.pool.trie.nodes if self.pool.trie is not None else None
            self.state_pool.check_invariants([s.seq_id for s in self.running], cached)
