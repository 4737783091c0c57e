"""Staging a step on the device: the StepInputs an eager forward and the speculative bookkeeping
read (with the attention's split counts on CUDA), or a verify graph's `extra` arrays, and the
`fix` that moves the inputs past the MTP step still in flight. Enqueued copies only: no host
sync. The functions take the ModelRunner (duck-typed, as warmup.py does)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyserve.kernels.prefill_attention import prefill_num_splits
from tinyserve.kernels.spec_shift import shift_inputs
from tinyserve.runner.graph_shapes import decode_num_splits, decode_tiling
from tinyserve.runner.pending import PendingStep
from tinyserve.runner.step_inputs import HostInputs, StepInputs, device_inputs


@dataclass(slots=True)
class Staged:
    """`stage`'s result: what a step's forward and bookkeeping read on the device."""

    x: StepInputs | None  # None: a plain graph step, or a verify-graph step (`extra`)
    graphed: bool  # a verify-graph step: it accepts and drafts in `draft_graphs`
    extra: list | tuple = ()  # the verify replay's `extra` arrays
    fix: Callable | None = None  # edits a replay's copied inputs (the MTP step in flight)
    shift: tuple[torch.Tensor, ...] | None = None  # HostInputs.shift_* on the device
    seg_dev: torch.Tensor | None = None  # (S,) each sampled sequence's first logits row


def stage(runner, h: HostInputs, graphs, prev: PendingStep | None) -> Staged:
    """The step's device inputs: StepInputs (eager forward, speculative bookkeeping) or a
    verify graph's `extra` arrays, and the `fix` past the MTP step in flight (`shift`)."""
    # A verify-graph step of an MTP model accepts and drafts in a graph of its own, right
    # after the verify replay; its drafts, KV limits and shift entries go to the device with
    # the replay's inputs (`extra`), so it needs no StepInputs. Plain graph steps copy
    # nothing else either: the graph reads its own buffer.
    graphed = runner.mtp is not None and graphs is not None and graphs is runner.verify_graphs
    plain = graphs is not None and not h.spec and runner.mtp is None
    x = None if graphed or plain else step_device_inputs(runner, h)
    s = Staged(x, graphed)
    if graphed:
        extra = runner.draft_graphs.extras(h.draft_next, h.limits, runner.config.spec_force_accept)
        if h.shift_tok:
            extra += [
                h.shift_tok,
                h.shift_seq,
                h.shift_j,
                h.shift_row,
                h.shift_num,
                h.shift_logit,
            ]
        views = graphs.extra_views(len(h.q_lens), [len(e) for e in extra])
        draft_next, s.shift = views[0][: len(h.draft_next)], tuple(views[2:]) or None
        s.extra = extra
        s.seg_dev = runner.draft_graphs.seg_starts[: len(h.seg_starts)]  # every row q rows
    elif x is not None:
        draft_next, s.shift, s.seg_dev = x.draft_next, x.shift, x.seg_starts
    if (shift := s.shift) is None:  # else: tokens of the MTP step in flight
        return s

    def fix(*inputs, draft_next=draft_next):  # ids, positions, slots, ctx, tables
        outs = (prev.accepted, prev.sampled, prev.seg_dev, prev.drafts)
        shift_inputs(shift, outs, inputs, runner.block_size, draft_next)

    # A verify-graph step fixes its own buffers (`graphs.run`) and drafts from them;
    # otherwise the eager forward or the eager MTP drafting reads these.
    s.fix = fix
    if not graphed:
        md = x.metadata
        fix(x.input_ids, x.positions, md.slot_mapping, md.context_lens, md.block_tables)
        # A decode graph (eager MTP drafting) still fixes its own input buffers; the
        # drafts to verify are fixed already.
        s.fix = functools.partial(fix, draft_next=None) if graphs is not None else None
        if runner.device.type == "cpu":  # the CPU attention reads host lengths (no sync)
            md.context_lens_cpu = md.context_lens.tolist()
            md.max_context_len = max(md.context_lens_cpu)
        else:
            md.max_context_len += runner.config.num_speculative_tokens
    return s


def step_device_inputs(runner, h: HostInputs) -> StepInputs:
    """`device_inputs`, and on CUDA the attention's split counts (and decode tiling) for the
    step's shape: the decode rules graph steps take too (graph_shapes)."""
    x = device_inputs(h, runner.device, runner.mtp is not None)
    md = x.metadata
    if (md.is_decode_only or md.verify_query_len) and runner.device.type == "cuda":
        shape = (
            len(h.q_lens),
            runner.config.max_num_seqs,
            runner.model_config.num_key_value_heads,
            runner.max_blocks_per_seq * runner.block_size,
            runner.device,
        )
        md.num_splits = decode_num_splits(*shape, max(h.ctx_lens))
        md.decode_block_n, md.decode_min_split = decode_tiling(*shape, md.num_splits)
    elif runner.device.type == "cuda":
        mc = runner.model_config
        heads = (mc.num_attention_heads, mc.num_key_value_heads)
        md.prefill_num_splits = prefill_num_splits(
            h.q_lens, h.ctx_lens, *heads, runner.device, runner.dtype, mc.head_dim
        )
    return x
