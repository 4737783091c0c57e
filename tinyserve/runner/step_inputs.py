"""A step's inputs: built on the host from a ScheduledBatch (`build_host_inputs`), then copied
to the device (`device_inputs`). Pure functions of the batch; the runner owns what runs them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tinyserve.core.scheduler import ScheduledBatch, needs_prompt_logprobs
from tinyserve.core.sequence import PLACEHOLDER
from tinyserve.model.layers.attention import AttentionMetadata
from tinyserve.runner.states import HostStates
from tinyserve.sample.transfer import packed_to_device


@dataclass(slots=True)
class HostInputs:
    """One step's inputs as host lists, before any copy to the device."""

    input_ids: list[int]  # (T,) 0 where the token is still on the device (`dst`)
    positions: list[int]  # (T,)
    slots: list[int]  # (T,) KV cache slot of each token
    cu_q: list[int]  # (B + 1,) query offsets
    ctx_lens: list[int]  # (B,) KV length of each row including this step
    tables: np.ndarray  # (B, W) int32 block tables padded with 0 to one width
    q_lens: list[int]  # (B,)
    logits_idx: list[int]  # token index of each logits row (R,)
    seg_starts: list[int]  # first logits row of each sampling sequence (S,)
    draft_next: list[int]  # (R,) draft for the position after each row, -1 if none
    next_ids: list[int]  # (T,) token after each position where known (MTP's input)
    limits: list[int]  # (S,) KV slots owned by each sampling sequence
    sample_rows: list[int]  # (S,) batch row of each sampling sequence
    dst: list[int]  # input positions whose token the previous step sampled ...
    src: list[int]  # ... and its sampled row there
    # The overlapped speculative loop: tokens whose value and position come from the step in
    # flight (the row's last token, then its MTP drafts), one entry per token ...
    shift_tok: list[int]  # token index in this step
    shift_seq: list[int]  # the in-flight step's sampling sequence it follows
    shift_j: list[int]  # 0 for the row's last token, j for its j-th draft
    shift_row: list[int]  # batch row
    shift_num: list[int]  # drafts the row carries
    shift_logit: list[int]  # its logits row
    # Prompt logprobs (eager steps only): positions whose logits score the next prompt token.
    # Apart from `logits_idx`: the sampler never sees them.
    prompt_idx: list[int] = field(default_factory=list)  # (P,) token index in this step
    prompt_next: list[int] = field(default_factory=list)  # (P,) the prompt token it scores
    # (batch row, first position, num, top logprobs it asks) of each scored chunk
    prompt_rows: list[tuple[int, int, int, int]] = field(default_factory=list)
    prompt_top_k: int = 0  # the most top logprobs any of them asks
    states: HostStates | None = None  # hybrid models: the DeltaNet layers' state rows

    @property
    def spec(self) -> bool:
        return len(self.draft_next) > len(self.seg_starts)  # some row carries drafts


@dataclass(slots=True)
class StepInputs:
    """Device inputs of one step (the eager forward, and the speculative / MTP bookkeeping)."""

    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    idx: torch.Tensor  # (R,) logits_idx
    next_ids: torch.Tensor | None  # (T,) MTP only
    draft_next: torch.Tensor | None  # (R,) speculative steps only
    seg_starts: torch.Tensor | None  # (S,) speculative or MTP steps
    kv_limits: torch.Tensor | None  # (S,) MTP only
    max_kv_limit: int
    sample_rows: torch.Tensor | None  # (S,) MTP only
    pending: tuple[torch.Tensor, torch.Tensor] | None  # (dst, src)
    shift: tuple[torch.Tensor, ...] | None  # HostInputs.shift_* on the device
    prompt: tuple[torch.Tensor, torch.Tensor] | None = None  # (prompt_idx, prompt_next)
    # A hybrid model's speculative step: (keep, spec_rows, spec_seqs) for commit_token_states.
    keep_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def build_host_inputs(batch: ScheduledBatch, block_size: int, mtp: bool) -> HostInputs:
    """One step's inputs on the host. `mtp`: the engine drafts with an MTP head (its rows need
    the token after each position, and continue the step in flight through `shift`)."""
    bs = block_size
    input_ids: list[int] = []
    next_ids: list[int] = []  # the token after each position where known (MTP's input)
    positions: list[int] = []
    slots: list[int] = []
    cu_q = [0]
    ctx_lens: list[int] = []
    logits_idx: list[int] = []
    draft_next: list[int] = []  # per logits row: the draft for the position after it, or -1
    seg_starts: list[int] = []  # per sampled sequence: its first logits row
    dst: list[int] = []  # batch positions whose token is a placeholder ...
    src: list[int] = []  # ... and the previous step's sampled row holding it
    limits: list[int] = []  # per sampled sequence: KV slots it owns
    sample_rows: list[int] = []  # per sampled sequence: its batch row
    shift: tuple[list[int], ...] = ([], [], [], [], [], [])  # HostInputs.shift_*
    prompt_idx: list[int] = []
    prompt_next: list[int] = []
    prompt_rows: list[tuple[int, int, int, int]] = []
    prompt_top_k = 0
    for row, (seq, num) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start, end = seq.num_kv_computed, seq.num_kv_computed + num
        drafts = seq.draft_ids
        if num == 1 and not drafts and not mtp and end == seq.num_tokens:
            # The common decode row, without the general path's slicing (host time per
            # step grows with the batch: this loop runs for every running sequence).
            tok = seq.token_ids[start]
            if tok == PLACEHOLDER:
                dst.append(len(input_ids))
                src.append(seq.pending_row)
                tok = 0
            input_ids.append(tok)
            positions.append(start)
            slots.append(seq.block_table[start // bs] * bs + start % bs)
            cu_q.append(cu_q[-1] + 1)
            ctx_lens.append(end)
            seg_starts.append(len(logits_idx))
            logits_idx.append(cu_q[-1] - 1)
            draft_next.append(-1)
            limits.append(seq.kv_token_limit)
            sample_rows.append(row)
            continue
        tokens = seq.token_ids + drafts if drafts else seq.token_ids
        chunk = tokens[start:end]
        if mtp and chunk[0] == PLACEHOLDER:
            # The overlapped speculative loop: the last token and the drafts are the step
            # in flight's, and so is how far they move (kernels/spec_shift.py, on the device).
            assert end == seq.num_tokens + len(drafts), "a pending token in a prefill"
            first, logit = len(input_ids), len(logits_idx)
            for j in range(num):
                entry = (first + j, seq.pending_row, j, row, len(drafts), logit + j)
                for lst, v in zip(shift, entry):
                    lst.append(v)
            chunk = [0] * num
        elif seq.pending_row is not None and PLACEHOLDER in chunk:
            j = chunk.index(PLACEHOLDER)
            dst.append(len(input_ids) + j)
            src.append(seq.pending_row)
            chunk = chunk[:j] + [0] + chunk[j + 1 :]
        last = seq.num_prompt_tokens - 1  # position p's logits score prompt token p + 1
        if start < last and needs_prompt_logprobs(seq):
            num_scored, k = min(end, last) - start, seq.params.prompt_logprobs
            prompt_rows.append((row, start, num_scored, k))
            prompt_idx += range(len(input_ids), len(input_ids) + num_scored)
            prompt_next += seq.token_ids[start + 1 : start + 1 + num_scored]
            prompt_top_k = max(prompt_top_k, k)
        input_ids += chunk
        if mtp:
            following = chunk[1:] + tokens[end : end + 1]
            next_ids += following + [0] * (num - len(following))  # sampled ones: on device
        positions += range(start, end)
        table = seq.block_table
        if num <= 16:
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        else:  # long chunks in numpy: a Python loop per token would hold the GIL for ms
            pos = np.arange(start, end)
            blocks = np.asarray(table[start // bs : (end - 1) // bs + 1])
            slots += (blocks[pos // bs - start // bs] * bs + pos % bs).tolist()
        cu_q.append(cu_q[-1] + num)
        ctx_lens.append(end)
        if end >= seq.num_tokens:  # samples: the last known token, then each draft
            limits.append(seq.kv_token_limit)
            sample_rows.append(row)
            seg_starts.append(len(logits_idx))
            n = end - seq.num_tokens + 1
            logits_idx += range(cu_q[-1] - n, cu_q[-1])
            draft_next += drafts[: n - 1] + [-1]
    width = max(len(s.block_table) for s in batch.seqs)
    tables = np.zeros((len(batch.seqs), width), dtype=np.int32)  # one array, no nested lists
    for i, seq in enumerate(batch.seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return HostInputs(
        input_ids,
        positions,
        slots,
        cu_q,
        ctx_lens,
        tables,
        list(batch.num_new_tokens),
        logits_idx,
        seg_starts,
        draft_next,
        next_ids,
        limits,
        sample_rows,
        dst,
        src,
        *shift,
        prompt_idx=prompt_idx,
        prompt_next=prompt_next,
        prompt_rows=prompt_rows,
        prompt_top_k=prompt_top_k,
    )


def device_inputs(h: HostInputs, device: torch.device, mtp: bool) -> StepInputs:
    """Copy a step's host inputs to the device (one pinned, asynchronous copy)."""
    spec = h.spec
    host = {
        "tables": h.tables,
        "cu_q": np.asarray(h.cu_q, dtype=np.int32),
        "ctx": np.asarray(h.ctx_lens, dtype=np.int32),
        "slots": h.slots,
        "ids": h.input_ids,
        "positions": h.positions,
        "idx": h.logits_idx,
        "next_ids": h.next_ids,
        "draft_next": h.draft_next,
        "seg_starts": h.seg_starts,
        "limits": h.limits,
        "sample_rows": h.sample_rows,
        "dst": h.dst,
        "src": h.src,
        **{
            f"shift{i}": a
            for i, a in enumerate(
                (h.shift_tok, h.shift_seq, h.shift_j, h.shift_row, h.shift_num, h.shift_logit)
            )
        },
        **({"prompt_idx": h.prompt_idx, "prompt_next": h.prompt_next} if h.prompt_idx else {}),
    }
    hs = h.states
    if hs is not None:
        host |= {"state_slots": hs.slots, "has_init": hs.has_init}
        if hs.token_slots is not None:
            host |= {
                "token_slots": hs.token_slots,
                "keep": hs.keep,
                "spec_rows": hs.spec_rows,
                "spec_seqs": hs.spec_seqs,
            }
    d = dict(zip(host, packed_to_device(list(host.values()), device)))
    md = AttentionMetadata(
        slot_mapping=d["slots"],
        block_tables=d["tables"],
        cu_seqlens_q=d["cu_q"],
        context_lens=d["ctx"],
        query_lens_cpu=h.q_lens,
        context_lens_cpu=h.ctx_lens,
        max_context_len=max(h.ctx_lens),
        is_decode_only=all(n == 1 for n in h.q_lens),
        verify_query_len=h.q_lens[0] if spec and len(set(h.q_lens)) == 1 else 0,
    )
    keep_states = None
    if hs is not None:
        md.state_slots, md.has_initial_state = d["state_slots"], d["has_init"]
        if hs.token_slots is not None:
            md.token_state_slots = d["token_slots"]
            keep_states = (d["keep"], d["spec_rows"], d["spec_seqs"])
    return StepInputs(
        input_ids=d["ids"],
        positions=d["positions"],
        metadata=md,
        idx=d["idx"],
        next_ids=d["next_ids"] if mtp else None,
        draft_next=d["draft_next"] if spec else None,
        seg_starts=d["seg_starts"] if spec or mtp else None,
        kv_limits=d["limits"] if mtp else None,
        max_kv_limit=max(h.limits, default=0),
        sample_rows=d["sample_rows"] if mtp else None,
        pending=(d["dst"], d["src"]) if h.dst else None,
        shift=tuple(d[f"shift{i}"] for i in range(6)) if h.shift_tok else None,
        prompt=(d["prompt_idx"], d["prompt_next"]) if h.prompt_idx else None,
        keep_states=keep_states,
    )
