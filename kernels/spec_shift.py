"""The overlapped speculative loop's input fix-up, one launch (the torch version took ~25).

A speculative step is launched before the step in flight (`prev`) has reported how many drafts
it accepted, so the host builds the rows that continue it as if it accepted none, and this
kernel completes them on the device. `shift` holds one entry per such token: (token index in
this step, prev's sampling sequence it follows, j: 0 for the row's last token and j for its
j-th draft, batch row, drafts the row carries, its logits row). With a = the drafts prev's
sequence accepted:
  ids[tok]       <- prev's emitted token (sampled[seg_dev[seq] + a]) for j = 0, else draft j-1
  positions[tok] += a;  slots[tok] <- the slot of the new position in the row's block table
  ctx[row]       += a (once per row)
  draft_next[logit] <- prev's draft j where j < the row's drafts, else -1
`spec_shift(shift, prev, inputs, block_size, draft_next=None)`, all in place, with prev =
(accepted | None, sampled, seg_dev, drafts) and inputs = (ids, positions, slots, ctx, tables);
either part may be skipped (`inputs=None` or `draft_next=None`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check

_BLOCK = 256  # entries a program: one variant for every step size


# Sizes vary by step: each int that is 1 or a multiple of 16, each pointer's 16-byte alignment
# (graph buffers and eager inputs differ) and each block size compiled a variant mid-run (a
# compile stalls every stream for 0.2-1 s).
_UNSPECIALIZED = (
    "tok_ptr", "seq_ptr", "j_ptr", "row_ptr", "num_ptr", "logit_ptr", "n", "acc_ptr",
    "sampled_ptr", "seg_ptr", "drafts_ptr", "k", "ids_ptr", "pos_ptr", "slots_ptr", "ctx_ptr",
    "tables_ptr", "stride_table", "draft_next_ptr",
)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _shift_kernel(
    tok_ptr, seq_ptr, j_ptr, row_ptr, num_ptr, logit_ptr, n,
    acc_ptr, sampled_ptr, seg_ptr, drafts_ptr, k,
    ids_ptr, pos_ptr, slots_ptr, ctx_ptr, tables_ptr, stride_table, block_size, draft_next_ptr,
    HAS_ACC: tl.constexpr, FIX_INPUTS: tl.constexpr, FIX_DRAFTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n
    seq = tl.load(seq_ptr + e, mask=mask, other=0)
    j = tl.load(j_ptr + e, mask=mask, other=0)
    if HAS_ACC:
        a = tl.load(acc_ptr + seq, mask=mask, other=0)
    else:
        a = tl.zeros([BLOCK], tl.int64)
    if FIX_INPUTS:
        tok = tl.load(tok_ptr + e, mask=mask, other=0)
        row = tl.load(row_ptr + e, mask=mask, other=0).to(tl.int64)
        last = tl.load(sampled_ptr + tl.load(seg_ptr + seq, mask=mask, other=0) + a, mask=mask)
        draft = tl.load(drafts_ptr + seq * k + tl.maximum(j - 1, 0), mask=mask)
        tl.store(ids_ptr + tok, tl.where(j == 0, last, draft), mask=mask)
        pos = tl.load(pos_ptr + tok, mask=mask, other=0) + a
        tl.store(pos_ptr + tok, pos, mask=mask)
        block = tl.load(tables_ptr + row * stride_table + pos // block_size, mask=mask, other=0)
        tl.store(slots_ptr + tok, block.to(tl.int64) * block_size + pos % block_size, mask=mask)
        first = mask & (j == 0)  # a row's entries all move it by a: one of them writes
        ctx = tl.load(ctx_ptr + row, mask=first, other=0)
        tl.store(ctx_ptr + row, ctx + a.to(tl.int32), mask=first)
    if FIX_DRAFTS:
        num = tl.load(num_ptr + e, mask=mask, other=0)
        logit = tl.load(logit_ptr + e, mask=mask, other=0)
        draft = tl.load(drafts_ptr + seq * k + tl.minimum(j, k - 1), mask=mask & (j < num))
        tl.store(draft_next_ptr + logit, tl.where(j < num, draft, -1), mask=mask)


def spec_shift(shift: tuple[torch.Tensor, ...], prev: tuple, inputs: tuple | None,
               block_size: int, draft_next: torch.Tensor | None = None) -> None:
    accepted, sampled, seg_dev, drafts = prev
    n = shift[0].shape[0]
    check(all(t.shape == (n,) and t.dtype == torch.long and t.is_contiguous() for t in shift),
          "shift: six contiguous (n,) int64 tensors")
    check(drafts.dim() == 2 and drafts.stride(1) == 1 and drafts.dtype == torch.long,
          "drafts: (S, k) int64, rows contiguous")
    check(drafts.stride(0) == drafts.shape[1], "drafts: contiguous rows")
    for t in (sampled, seg_dev) + ((accepted,) if accepted is not None else ()):
        check(t.dtype == torch.long and t.is_contiguous(), "prev's outputs: contiguous int64")
    fix_inputs = inputs is not None
    if fix_inputs:
        ids, positions, slots, ctx, tables = inputs
        for t in (ids, positions, slots):
            check(t.dtype == torch.long and t.is_contiguous(), "ids, positions, slots: int64")
        check(ctx.dtype == torch.int32 and ctx.is_contiguous(), "ctx: contiguous int32")
        check(tables.dtype == torch.int32 and tables.dim() == 2 and tables.stride(1) == 1,
              "tables: (B, W) int32")
    if draft_next is not None:
        check(draft_next.dtype == torch.long and draft_next.is_contiguous(), "draft_next: int64")
    if n == 0 or not (fix_inputs or draft_next is not None):
        return
    dummy = shift[0]
    _shift_kernel[(triton.cdiv(n, _BLOCK),)](
        *shift, n, accepted if accepted is not None else dummy, sampled, seg_dev, drafts,
        drafts.shape[1], *(inputs if fix_inputs else (dummy,) * 5),
        tables.stride(0) if fix_inputs else 0, block_size,
        draft_next if draft_next is not None else dummy,
        HAS_ACC=accepted is not None, FIX_INPUTS=fix_inputs, FIX_DRAFTS=draft_next is not None,
        BLOCK=_BLOCK,
    )


def spec_shift_ref(shift: tuple[torch.Tensor, ...], prev: tuple, inputs: tuple | None,
                   block_size: int, draft_next: torch.Tensor | None = None) -> None:
    """The same in torch ops (no host sync)."""
    tok, seq, j, row, num, logit = shift
    accepted, sampled, seg_dev, drafts = prev
    a = accepted[seq] if accepted is not None else torch.zeros_like(seq)
    k = drafts.shape[1]
    if inputs is not None:
        ids, positions, slots, ctx, tables = inputs
        last = sampled[seg_dev[seq] + a]
        ids[tok] = torch.where(j == 0, last, drafts[seq, (j - 1).clamp(min=0)])
        pos = positions[tok] + a
        positions[tok] = pos
        slots[tok] = tables[row, pos // block_size].long() * block_size + pos % block_size
        ctx[row] = ctx[row] + a.to(ctx.dtype)  # every token of a row writes the same value
    if draft_next is not None:
        draft_next[logit] = torch.where(j < num, drafts[seq, j.clamp(max=k - 1)], -1)


def shift_inputs(shift: tuple[torch.Tensor, ...], prev: tuple, inputs: tuple | None,
                 block_size: int, draft_next: torch.Tensor | None = None) -> None:
    """`spec_shift` on a CUDA device, `spec_shift_ref` elsewhere (the CPU runs no compiled
    Triton)."""
    fn = spec_shift if shift[0].is_cuda else spec_shift_ref
    fn(shift, prev, inputs, block_size, draft_next)
