"""The state rows of a hybrid model's Gated DeltaNet layers: how many the runner allocates, and
each step's state inputs (which slot each row reads and advances, where a speculative step keeps
the state after each token, and which of those it keeps once the drafts are verified).

Slot layout (one row of every DeltaNet layer's conv window and recurrent matrix each):
  [0, max_num_seqs)   the sequences' slots, handed out by core/state_pool.py
  max_num_seqs        scratch: CUDA-graph padding rows and warm-up steps read zeros and write here
  after it            speculative engines only: one slot per token a verify step keeps
  checkpoint_base + c prefix caching: checkpoint c (core/state_pool.py), `checkpoint_budget` rows
                      (a negative c = slot - checkpoint_base: an idle runtime slot it borrowed)
A speculative step (any row carrying drafts) runs every DeltaNet layer token by token and writes
the state after each kept token to its own scratch slot, the sequences' slots only read; then
`commit_token_states` copies, on the device, the state after each row's last accepted token (a
row without drafts: its last token) into the row's slot. No host sync: the accepted counts stay
on the device. Checkpoint saves and restores are device row copies too (`copy_states`),
restores enqueued before the step's forward and saves after it; a speculative row's decode save
copies the per-token state its position lands on, found on the device (`save_token_states`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tinyserve.config import EngineConfig
from tinyserve.core.scheduler import ScheduledBatch
from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.gated_deltanet import allocate_states, state_bytes_per_slot
from tinyserve.sample.transfer import to_device

log = logging.getLogger("tinyserve.runner.states")


@dataclass(slots=True)
class HostStates:
    """One step's state inputs on the host."""

    slots: np.ndarray  # (B,) int32: each row's slot
    has_init: np.ndarray  # (B,) int32: 1 where the slot holds the state before the row's tokens
    # A speculative step's (else None): the slot each token's state goes to, -1 if not kept;
    token_slots: np.ndarray | None = None  # (T,) int32
    keep: list[int] | None = None  # (B,) the scratch slot of each row's first kept state ...
    spec_rows: list[int] | None = None  # ... moved on by the accepted drafts of these rows ...
    spec_seqs: list[int] | None = None  # ... whose sampling sequences these are


def num_state_slots(
    max_num_seqs: int, num_speculative_tokens: int | None, max_num_batched_tokens: int
) -> int:
    """Sequences' slots, the scratch slot, and a speculative step's per-token slots (one per
    kept token: at most 1 + k a row, and one a token of the step)."""
    per_token = 0
    if num_speculative_tokens:
        per_token = min(max_num_seqs * (num_speculative_tokens + 1), max_num_batched_tokens)
    return max_num_seqs + 1 + per_token


def checkpoint_budget(config: EngineConfig) -> int:
    """Checkpoint rows: `prefix_cache_state_budget`; none without prefix caching. The default
    is a quarter of max_num_seqs (at least 1). A checkpoint row costs what a runtime slot does
    (49 MiB on Qwen3.5-9B: the KV of ~1.6k tokens), so max_num_seqs of them doubled the state
    rows' memory: 12 GiB at 256 sequences, about a third of what an 80 GB H100 leaves the KV
    cache after the 9B's weights, its forward and the runtime slots (an estimate). Idle runtime
    slots hold checkpoints too (borrowed: core/state_pool.py), so the dedicated rows count
    under full load, for what eviction keeps there: shared prompts and recent chat turns."""
    if not config.enable_prefix_caching:
        return 0
    budget = config.prefix_cache_state_budget
    return max(1, config.max_num_seqs // 4) if budget is None else budget


def state_pool_size(mc: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, bytes) of a model's state rows, checkpoints last; (0, 0) for a model without
    DeltaNet layers."""
    if "linear_attention" not in mc.layer_types:
        return 0, 0
    # A speculative engine (n-gram or MTP) keeps each verified token's state in rows of its own.
    k = config.num_speculative_tokens if config.speculative_method is not None else None
    num = num_state_slots(config.max_num_seqs, k, config.max_num_batched_tokens)
    num += checkpoint_budget(config)
    return num, num * state_bytes_per_slot(mc, dtype, getattr(torch, mc.ssm_state_dtype))


def copy_states(
    states: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor
) -> None:
    """Rows `src` of every DeltaNet layer's states into rows `dst` (device index tensors)."""
    for conv, ssm in states:
        conv.index_copy_(0, dst, conv.index_select(0, src))
        ssm.index_copy_(0, dst, ssm.index_select(0, src))


def allocate_state_rows(
    model: torch.nn.Module, mc: ModelConfig, num_slots: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every DeltaNet layer's rows (conv windows in the model dtype, recurrent matrices in the
    checkpoint's state dtype): the (conv, ssm) pairs, layer by layer."""
    states = allocate_states(model, num_slots, getattr(torch, mc.ssm_state_dtype))
    num_bytes = sum(t.numel() * t.element_size() for pair in states for t in pair)
    log.info("state rows: %d slots, %.1f MiB", num_slots, num_bytes / 2**20)
    return states


def host_states(batch: ScheduledBatch, scratch: int, spec: bool) -> HostStates:
    """`batch.state_slots` (None: warm-up rows on the scratch slot). `spec`: some row carries
    drafts, so every row keeps its states in per-token scratch slots after `scratch`."""
    num = len(batch.seqs)
    slots = np.asarray(batch.state_slots or [scratch] * num, dtype=np.int32)
    has_init = np.fromiter((s.num_kv_computed > 0 for s in batch.seqs), np.int32, num)
    if batch.state_slots is None:
        has_init[:] = 0  # warm-up rows: the scratch slot holds nothing
    if not spec:
        return HostStates(slots, has_init)
    token_slots = np.full(batch.num_tokens, -1, dtype=np.int32)
    keep, spec_rows, spec_seqs = [], [], []
    first, base, num_sampled = 0, scratch + 1, 0
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        end = first + n
        drafts = max(0, seq.num_kv_computed + n - seq.num_tokens)  # tokens past the known ones
        token_slots[end - 1 - drafts : end] = np.arange(base, base + drafts + 1)
        keep.append(base)
        if drafts:  # the state after the last token, then one after each draft
            spec_rows.append(row)
            spec_seqs.append(num_sampled)
        num_sampled += batch.samples(row)
        base += drafts + 1
        first = end
    return HostStates(slots, has_init, token_slots, keep, spec_rows, spec_seqs)


def commit_token_states(
    states: list[tuple[torch.Tensor, torch.Tensor]],
    slots: torch.Tensor,
    keep: torch.Tensor,
    spec_rows: torch.Tensor,
    spec_seqs: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """After a speculative step: each row's slot takes the state after its last accepted token,
    kept in scratch slot keep[r] + accepted drafts (rows without drafts: + 0). On the device."""
    src = keep.clone()
    src.index_add_(0, spec_rows, accepted.index_select(0, spec_seqs).to(src.dtype))
    dst = slots.long()
    for conv, ssm in states:
        conv.index_copy_(0, dst, conv.index_select(0, src))
        ssm.index_copy_(0, dst, ssm.index_select(0, src))


def commit_graphed_states(
    states: list[tuple[torch.Tensor, torch.Tensor]],
    host: HostStates,
    slots: torch.Tensor,
    accepted: torch.Tensor,
    device: torch.device,
) -> None:
    """`commit_token_states` after a verify replay: its rows' slots are the graph's inputs
    (`slots`), the kept rows' bookkeeping goes over in one copy."""
    b, r = len(host.slots), len(host.spec_rows)
    keep = to_device(host.keep + host.spec_rows + host.spec_seqs, device)
    commit_token_states(states, slots, keep[:b], keep[b : b + r], keep[b + r :], accepted)


def save_token_states(
    states: list[tuple[torch.Tensor, torch.Tensor]],
    batch: ScheduledBatch,
    keep: list[int],
    positions: torch.Tensor,
    dst: list[int],
    device: torch.device,
) -> None:
    """Speculative rows' decode saves (`batch.token_saves`) into rows `dst`: the state after
    position p tokens is the row's per-token state j = p - 1 - (its first token's position on
    the device, which drafts of the step in flight may have moved), clamped to the row's
    tokens: a save whose token was not accepted copies some state the engine then drops.
    `keep`: each row's first per-token slot; `positions` (T,) int64, the step's."""
    rows, pos, _ = zip(*batch.token_saves)
    starts = np.cumsum([0, *batch.num_new_tokens])
    host = [starts[r] for r in rows] + [keep[r] for r in rows]
    host += [batch.num_new_tokens[r] - 1 for r in rows] + list(pos) + list(dst)
    first, kept, last, pos_dev, dst_dev = to_device(host, device).split(len(rows))
    j = torch.minimum((pos_dev - 1 - positions.index_select(0, first)).clamp(min=0), last)
    copy_states(states, kept + j, dst_dev)
