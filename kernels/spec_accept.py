"""Accepted drafts of a speculative step, one launch: `accept_drafts(sampled (R,), draft_next
(R,), seg_starts (S,), max_rows, force=None)` -> accepted (S,) int64.

Logits rows come in segments, one per sampling sequence (rows seg_starts[s] up to the next
start): the target's token at each of its positions, the last one included. draft_next[r] is
the draft proposed for the position after row r, -1 where none, so a segment's last row always
mismatches. A sequence accepts its drafts up to the first row whose sampled token differs.
`force` (benchmarks only) accepts min(force, drafts) whatever the target says, and writes those
drafts into `sampled` in place (the tokens the step then emits); as a device tensor, -1 is none.
`last` (S,) int64 receives each segment's last verified row, seg_starts + accepted (where the
MTP head drafts from), and `copies` (two int64 tensors) the step's tokens, each up to its
length (the drafting graph's results and the decode graphs' inputs), without kernels of their
own.
The torch version took ~15 small launches, paid on every speculative step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check, next_pow2


# Counts vary by step: Triton would compile a variant for each int that is 1 or a multiple of 16
# (a force of 1 became a constant, which failed to compile) and for each pointer's alignment.
@triton.jit(do_not_specialize=["sampled_ptr", "draft_ptr", "starts_ptr", "acc_ptr", "last_ptr",
                             "copy_a_ptr", "copy_b_ptr", "len_a", "len_b", "num_rows",
                             "num_segs", "force", "force_ptr"])
def _accept_kernel(sampled_ptr, draft_ptr, starts_ptr, acc_ptr, last_ptr, copy_a_ptr,
                   copy_b_ptr, len_a, len_b, num_rows, num_segs, force, force_ptr,
                   BLOCK_R: tl.constexpr, FORCE_AT: tl.constexpr, HAS_LAST: tl.constexpr,
                   HAS_COPIES: tl.constexpr):
    s = tl.program_id(0)
    start = tl.load(starts_ptr + s)
    end = tl.load(starts_ptr + s + 1, mask=s + 1 < num_segs, other=num_rows)
    i = tl.arange(0, BLOCK_R)
    rows = start + i
    inside = rows < end
    draft = tl.load(draft_ptr + rows, mask=inside, other=-1)
    if FORCE_AT:  # the count lives on the device: a CUDA graph reads it at each replay
        force = tl.load(force_ptr)
    token = tl.load(sampled_ptr + rows, mask=inside, other=-1)
    if force >= 0:
        last = tl.min(tl.where(inside & (draft < 0), i, BLOCK_R), 0)
        accepted = tl.minimum(last.to(tl.int64), force.to(tl.int64))
        take = inside & (i < accepted)
        tl.store(sampled_ptr + rows, draft, mask=take)
        token = tl.where(take, draft, token)
    else:
        accepted = tl.min(tl.where(inside & (token != draft), i, BLOCK_R), 0).to(tl.int64)
    tl.store(acc_ptr + s, accepted)
    if HAS_LAST:
        tl.store(last_ptr + s, start + accepted)
    if HAS_COPIES:
        tl.store(copy_a_ptr + rows, token, mask=inside & (rows < len_a))
        tl.store(copy_b_ptr + rows, token, mask=inside & (rows < len_b))


def accept_drafts(
    sampled: torch.Tensor,
    draft_next: torch.Tensor,
    seg_starts: torch.Tensor,
    max_rows: int,
    force: int | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    copies: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Segments are at most `max_rows` rows long (k + 1). `force` may also be a (1,) int64
    device tensor, -1 for none (read by the kernel: a graph replays it with its current
    value); `out` (S,) int64 receives the counts, `last` (S,) int64 the last verified rows,
    `copies` (two 1-D int64 tensors) the tokens."""
    check(sampled.dtype == draft_next.dtype == seg_starts.dtype == torch.long, "int64 inputs")
    check(sampled.shape == draft_next.shape and sampled.dim() == 1, "sampled, draft_next: (R,)")
    check(sampled.is_contiguous() and draft_next.is_contiguous() and seg_starts.is_contiguous(),
          "contiguous inputs")
    num_segs = seg_starts.shape[0]
    at = isinstance(force, torch.Tensor)
    check(not at or (force.shape == (1,) and force.dtype == torch.long), "force: (1,) int64")
    accepted = out if out is not None else torch.empty(num_segs, dtype=torch.long,
                                                       device=sampled.device)
    check(accepted.shape == (num_segs,) and accepted.dtype == torch.long, "out: (S,) int64")
    check(last is None or (last.shape == (num_segs,) and last.dtype == torch.long
                           and last.is_contiguous()), "last: (S,) int64")
    a, b = copies if copies is not None else (accepted, accepted)
    check(copies is None or all(c.dtype == torch.long and c.dim() == 1 and c.is_contiguous()
                                for c in copies), "copies: 1-D int64")
    if num_segs:
        _accept_kernel[(num_segs,)](
            sampled, draft_next, seg_starts, accepted, accepted if last is None else last, a, b,
            len(a), len(b), sampled.shape[0], num_segs, -1 if force is None or at else force,
            force if at else accepted, BLOCK_R=next_pow2(max(max_rows, 2)), FORCE_AT=at,
            HAS_LAST=last is not None, HAS_COPIES=copies is not None,
        )
    return accepted


def accept_drafts_ref(
    sampled: torch.Tensor,
    draft_next: torch.Tensor,
    seg_starts: torch.Tensor,
    force: int | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    copies: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Torch ops, no host sync: the first mismatching row of each segment by scatter-min."""
    num_rows, num_segs = sampled.shape[0], seg_starts.shape[0]
    rows = torch.arange(num_rows, device=sampled.device)
    seg_ids = torch.searchsorted(seg_starts, rows, right=True) - 1  # each row's segment
    first = torch.full((num_segs,), num_rows, device=sampled.device)
    miss = torch.where(sampled != draft_next, rows, num_rows)
    accepted = first.scatter_reduce(0, seg_ids, miss, "amin") - seg_starts
    if force is not None:
        if not isinstance(force, torch.Tensor):
            force = torch.tensor([force], device=sampled.device)
        stop = torch.where(draft_next < 0, rows, num_rows)  # the last row of each sequence
        forced = torch.minimum(first.scatter_reduce(0, seg_ids, stop, "amin") - seg_starts,
                               force)
        accepted = torch.where(force >= 0, forced, accepted)
        take = (force >= 0) & (rows - seg_starts[seg_ids] < accepted[seg_ids])
        sampled.copy_(torch.where(take, draft_next, sampled))
    if last is not None:
        torch.add(seg_starts, accepted, out=last)
    for c in copies or ():
        n = min(len(c), num_rows)
        c[:n].copy_(sampled[:n])
    return accepted if out is None else out.copy_(accepted)


def accept(
    sampled: torch.Tensor,
    draft_next: torch.Tensor,
    seg_starts: torch.Tensor,
    max_rows: int,
    force: int | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    copies: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`accept_drafts` on a CUDA device, `accept_drafts_ref` elsewhere (the CPU runs no
    compiled Triton)."""
    if sampled.is_cuda:
        return accept_drafts(sampled, draft_next, seg_starts, max_rows, force, out, last, copies)
    return accept_drafts_ref(sampled, draft_next, seg_starts, force, out, last, copies)
