"""Hybrid prefix caching's checkpoint policy: where a row saves its state, and where a prompt's
chunks end so that its saves lie where later prompts resume. Plain functions of the scheduler
(core/scheduler.py): they read its pools and waiting prompts and add to the step's saves; the
slots themselves are core/state_pool.py's. No CUDA here.

A row whose chunk ends on a block boundary saves its state there (a checkpoint slot,
`state_saves`; a decode row only every `decode_interval` blocks and at the last block end its
`max_tokens` reach, and one whose position only the device knows, drafts in flight, as
`may_save_speculative` says). A prompt's chunks end at its
branch points (`seq.branch_points`), so its state is saved there and every later prompt sharing
the prefix resumes at one: for a hit clamped short of the matched blocks, the last of them; for
a prompt admitted while others sharing its first blocks wait (they wait for its blocks:
`Scheduler._is_in_flight`), the deepest block end it shares with each of them (the
MAX_BRANCH_POINTS most shared). Those then hit the leader's checkpoints instead of the first of
them recomputing the shared prefix privately (delaying them alone would: the leader's own saves
lie at its chunk ends, inside its private suffix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.sequence import Sequence

if TYPE_CHECKING:
    from tinyserve.core.scheduler import Scheduler

# A prompt's chunks end at no more branch points than this (each costs a chunk and a checkpoint).
MAX_BRANCH_POINTS = 2


def cut_at_branch_point(seq: Sequence, num: int) -> int:
    """`num` tokens of `seq` from its computed ones, ending at its next branch point if that
    lies before (a branch checkpoint is saved at a chunk end)."""
    start = seq.num_kv_computed
    nxt = next((p for p in seq.branch_points if p > start), None)
    return num if nxt is None else min(num, nxt - start)


def shared_boundaries(sched: Scheduler, seq: Sequence) -> list[int]:
    """The block ends past `seq`'s matched tokens where waiting prompts branch from it: each
    one's deepest block end whose prefix it shares (and would match: its key's token after
    the block too, with `key_next_token`), the MAX_BRANCH_POINTS most shared. Hybrid prefix
    caching only: a KV-only cache needs no state there. A waiting prompt is compared only
    if it shares the next block (one slice); then the previous one's branch is tried first
    (the followers of a prompt mostly branch at one place), else found by bisection."""
    states, pool = sched.state_pool, sched.pool
    if states is None or not states.can_checkpoint or pool.trie is None:
        return []
    bs, kn = pool.block_size, int(pool.key_next_token)
    ids = seq.token_ids
    start = seq.num_kv_computed // bs  # in blocks from here on
    count: dict[int, int] = {}
    last = 0
    for other in sched.waiting:
        if other is seq or other.cache_salt != seq.cache_salt or other.mm_spans or seq.mm_spans:
            continue
        hi = (min(seq.num_prompt_tokens, other.num_prompt_tokens) - 1 - kn) // bs
        nxt = (start + 1) * bs + kn
        if hi <= start or other.token_ids[start * bs] != ids[start * bs]:
            continue  # (one id first: most waiting prompts differ at once, no slices)
        if other.token_ids[start * bs : nxt] != ids[start * bs : nxt]:
            continue
        if other.token_ids[: start * bs] != ids[: start * bs]:
            continue

        def shares(blocks: int, other=other) -> bool:
            n = blocks * bs + kn
            return other.token_ids[:n] == ids[:n]

        lo = start + 1  # shared; the deepest shared block count in [lo, hi]:
        if last and last <= hi:
            if shares(last):
                lo = last
            else:
                hi = last - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if shares(mid) else (lo, mid - 1)
        count[lo] = count.get(lo, 0) + 1
        last = lo
    best = sorted(count, key=lambda b: (-count[b], -b))[:MAX_BRANCH_POINTS]
    return [b * bs for b in best]


def may_checkpoint(sched: Scheduler, seq: Sequence, num: int) -> None:
    """The saves of `seq`'s state the policy wants after its `num` tokens scheduled this step
    (before the scheduler adds its row); a save at its branch point is a branch checkpoint."""
    states, pool = sched.state_pool, sched.pool
    if states is None or not states.can_checkpoint or pool.trie is None:
        return
    end = seq.num_kv_computed + num
    if seq.draft_ids or seq.num_unverified:  # positions known on the device only
        if states.decode_interval and seq.num_kv_computed >= seq.num_prompt_tokens:
            may_save_speculative(sched, seq, num)
    elif (
        end % pool.block_size == 0
        and num <= seq.num_uncomputed
        and seq.block_table[end // pool.block_size - 1] not in states.checkpoint_of
    ):
        may_save(sched, seq, end, end in seq.branch_points)


def may_save(sched: Scheduler, seq: Sequence, end: int, branch: bool) -> None:
    """A checkpoint of `seq`'s state after `end` tokens (a block end), if the policy wants
    one there: every prompt chunk end; in decode, the end of the block the prompt ends in,
    every `decode_interval` blocks after it and the last block end `max_tokens` reaches
    (core/state_pool.py says why)."""
    states = sched.state_pool
    decode = seq.num_kv_computed >= seq.num_prompt_tokens
    if decode:
        step = sched.pool.block_size * states.decode_interval
        off_grid = not step or (end - first_decode_save(sched.pool, seq)) % step
        if off_grid and not (step and end == last_decode_save(sched.pool, seq)):
            return
    ck = states.take_checkpoint(seq.seq_id, end, decode, branch)
    if ck is not None:
        sched._saves.append((states.owners[seq.seq_id], ck))


def first_decode_save(pool: BlockPool, seq: Sequence) -> int:
    """The first decode save position: the end of the block the prompt ends in."""
    bs = pool.block_size
    return -(-seq.num_prompt_tokens // bs) * bs


def last_decode_save(pool: BlockPool, seq: Sequence) -> int:
    """The last decode save position, off the interval's grid: the deepest block a next
    chat turn can resume at if `seq` answers `max_tokens` tokens (KV for all but the last
    token; with `key_next_token`, its block's key needs the token after it). Without it
    that turn would recompute up to `decode_interval` blocks of the answer."""
    bs, kn = pool.block_size, int(pool.key_next_token)
    return (seq.num_prompt_tokens + seq.max_tokens - 1 - kn) // bs * bs


def may_save_speculative(sched: Scheduler, seq: Sequence, num: int) -> None:
    """Decode saves for a row whose tokens' positions are known only on the device (drafts
    the step in flight accepts move them up to `num_unverified`) and, if it carries drafts,
    which of its `num` tokens are accepted only after the step: every decode save position
    this step may reach is saved (from the per-token state that may hold it, or the row's
    state after its one token) and the engine drops each save unless an accepted token
    ended there, so each position the steps reach is saved by exactly one of them (one
    candidate a step, at the default interval)."""
    states = sched.state_pool
    step = sched.pool.block_size * states.decode_interval
    first = first_decode_save(sched.pool, seq)
    start = seq.num_kv_computed  # the row's tokens: positions after start + 0..unverified
    p = first if start < first else first + (start - first) // step * step + step
    stop = start + seq.num_unverified + num + 1
    positions = set(range(p, stop, step))
    last = last_decode_save(sched.pool, seq)
    if max(start, first) < last < stop:
        positions.add(last)
    row = len(sched._batch)  # (the row is added after its saves)
    for position in sorted(positions):
        ck = states.take_checkpoint(seq.seq_id, position, speculative=True)
        if ck is None:
            return
        if seq.draft_ids:  # (a row carrying drafts keeps a state per token)
            sched._token_saves.append((row, position, ck))
        else:
            sched._saves.append((states.owners[seq.seq_id], ck))
            sched._unsure_saves.append((row, position, ck))
