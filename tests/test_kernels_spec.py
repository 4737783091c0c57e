"""The speculative-decoding kernels: draft acceptance (accept_drafts) and the shift of a
step's inputs by the step in flight (spec_shift), against their torch versions."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, needs_triton

from tinyserve.kernels.spec_accept import accept_drafts, accept_drafts_ref
from tinyserve.kernels.spec_shift import spec_shift, spec_shift_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=DEVICE)


def test_accept_drafts_per_segment():
    """Three sequences: 2 drafts both accepted, 3 drafts the first rejected, none; forced
    acceptance writes the accepted drafts into `sampled`."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    assert accept_drafts(sampled, draft_next, starts, 4).tolist() == [2, 0, 0]
    assert accept_drafts_ref(sampled, draft_next, starts).tolist() == [2, 0, 0]
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        forced = sampled.clone()
        assert fn(forced, draft_next, *args, force=1).tolist() == [1, 1, 0]
        assert forced.tolist() == [5, 6, 7, 8, 2, 3, 4, 9]


@pytest.mark.parametrize("force", [None, 1])
def test_accept_drafts_writes_the_last_verified_rows_and_tokens(force):
    """`last`: each segment's start plus its accepted count; `copies`: the step's tokens (forced
    drafts included), each up to its length; from the kernel and the ref."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    want = [2, 3, 7] if force is None else [1, 4, 7]
    tokens = [5, 6, 7, 1, 2, 3, 4, 9] if force is None else [5, 6, 7, 8, 2, 3, 4, 9]
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        last, a, b = _long([-9, -9, -9]), _long([-9] * 8), _long([-9] * 5)
        fn(sampled.clone(), draft_next, *args, force=force, last=last, copies=(a, b))
        assert last.tolist() == want
        assert a.tolist() == tokens and b.tolist() == tokens[:5]  # the step's tokens, forced


def test_accept_drafts_reads_a_device_force():
    """force as a (1,) device tensor (what a CUDA graph replays): -1 accepts by the tokens, a
    count forces as the int does, into `out`."""
    sampled, draft_next = _long([5, 6, 7, 1, 2, 3, 4, 9]), _long([5, 6, -1, 8, 2, 3, -1, -1])
    starts = _long([0, 3, 7])
    for fn, args in ((accept_drafts, (starts, 4)), (accept_drafts_ref, (starts,))):
        out = _long([9, 9, 9])
        assert fn(sampled.clone(), draft_next, *args, force=_long([-1]), out=out) is out
        assert out.tolist() == [2, 0, 0]
        forced = sampled.clone()
        assert fn(forced, draft_next, *args, force=_long([1])).tolist() == [1, 1, 0]
        assert forced.tolist() == [5, 6, 7, 8, 2, 3, 4, 9]


@pytest.mark.parametrize("force", [None, 0, 1, 2])
def test_accept_drafts_matches_ref(force):
    """Random segments of 1..k+1 rows whose drafts match the target's tokens at random (a
    force of 1 once failed to compile on the GPU: Triton made it a constant)."""
    g = torch.Generator().manual_seed(1)
    k, lengths = 3, torch.randint(1, 5, (37,), generator=g)
    rows = int(lengths.sum())
    starts = torch.cumsum(lengths, 0) - lengths
    sampled = torch.randint(0, 4, (rows,), generator=g)
    draft_next = torch.where(
        torch.rand(rows, generator=g) < 0.7, sampled, torch.randint(0, 4, (rows,), generator=g)
    )
    draft_next[starts + lengths - 1] = -1  # a segment's last row proposes nothing
    out, ref = sampled.clone().to(DEVICE), sampled.clone().to(DEVICE)
    dn, st = draft_next.to(DEVICE), starts.to(DEVICE)
    acc = accept_drafts(out, dn, st, k + 1, force)
    assert torch.equal(acc, accept_drafts_ref(ref, dn, st, force))
    assert torch.equal(out, ref)
    total = int(acc.sum())
    assert total < rows - 37  # some drafts rejected ...
    assert total > 0 or force == 0  # ... and some accepted


@pytest.mark.parametrize("with_accepted", [True, False])
@pytest.mark.parametrize("part", ["both", "inputs", "drafts"])
def test_spec_shift_matches_ref(with_accepted, part):
    """Rows continuing an in-flight step (in a shuffled order, some with fewer drafts) get its
    tokens, and move by its accepted counts, as the torch version does."""
    g = torch.Generator().manual_seed(2)
    k, block_size, num_prev = 3, 4, 9
    accepted = torch.randint(0, k + 1, (num_prev,), generator=g)
    sampled = torch.randint(0, 1000, (num_prev * (k + 1),), generator=g)
    seg_dev = torch.arange(0, num_prev * (k + 1), k + 1)
    drafts = torch.randint(0, 1000, (num_prev, k), generator=g)
    follows = torch.randperm(num_prev, generator=g)[:7].tolist()  # this step's 7 rows
    nums = [1 + (k if i % 3 else i % k) for i in range(7)]  # tokens per row: 1 + drafts
    entries = [
        (sum(nums[:r]) + j, s, j, r, nums[r] - 1, sum(nums[:r]) + j)
        for r, s in enumerate(follows)
        for j in range(nums[r])
    ]
    shift = tuple(_long(list(col)) for col in zip(*entries))
    tokens = sum(nums)
    tables = torch.randperm(100, generator=g)[: 7 * 12].view(7, 12).to(torch.int32)
    ctx = torch.tensor([30 + 2 * r for r in range(7)], dtype=torch.int32)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx.tolist(), nums)])
    state = {
        "ids": torch.zeros(tokens, dtype=torch.long),
        "positions": positions,
        "slots": torch.full((tokens,), -7),
        "ctx": ctx,
        "tables": tables,
        "draft_next": torch.full((tokens,), -5),
    }
    outs = []
    for fn in (spec_shift, spec_shift_ref):
        st = {name: v.clone().to(DEVICE) for name, v in state.items()}
        inputs = tuple(st[n] for n in ("ids", "positions", "slots", "ctx", "tables"))
        prev = (
            accepted.to(DEVICE) if with_accepted else None,
            sampled.to(DEVICE),
            seg_dev.to(DEVICE),
            drafts.to(DEVICE),
        )
        fn(
            shift,
            prev,
            None if part == "drafts" else inputs,
            block_size,
            None if part == "inputs" else st["draft_next"],
        )
        outs.append(st)
    for name in state:
        assert torch.equal(outs[0][name], outs[1][name]), name
    if part != "drafts":
        assert not torch.equal(outs[0]["ids"], state["ids"].to(DEVICE))
        assert (outs[0]["slots"] >= 0).all()
