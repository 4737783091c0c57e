"""MTP drafting: the MTP head over a step's tokens (writing its own KV), then k drafts per
sequence. Device tensors only, no host reads: the verify graph's drafting (`draft_graphs.py`)
captures `draft_tokens` as the eager steps run it."""

from __future__ import annotations

import torch

from tinyserve.model.layers.attention import AttentionMetadata, forward_context
from tinyserve.runner.step_inputs import StepInputs


class MtpDrafter:
    def __init__(
        self,
        mtp,
        num_speculative_tokens: int,
        block_size: int,
        num_kv_blocks: int,
        max_position: int,
    ) -> None:
        self.mtp = mtp
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.scratch_slot = num_kv_blocks * block_size  # the cache's last block: never handed out
        self.max_position = max_position

    def first_pass(
        self,
        md: AttentionMetadata,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The MTP layer over every token of the step, at the target's positions and slots:
        writes its KV (entry i from target hidden h_i and token t_{i+1}), returns its output."""
        with forward_context(md):
            return self.mtp(next_ids, hidden, positions, target_hidden=True)

    def drafts(
        self,
        x: StepInputs,
        hidden: torch.Tensor,
        sampled: torch.Tensor,
        accepted: torch.Tensor | None,
    ) -> torch.Tensor:
        """k drafts per sampling sequence (S, k), on the device, after an eager forward or a
        decode graph (a verify graph drafts in its own graph: `DraftGraphs`)."""
        next_ids = x.next_ids.index_put((x.idx,), sampled)  # sampled tokens follow logits rows
        if accepted is None:
            accepted = torch.zeros_like(x.seg_starts)
        chosen = x.idx[x.seg_starts] + accepted  # token index of the last verified position
        tables = x.metadata.block_tables[x.sample_rows]  # (S, W)
        return self.draft_tokens(
            x.metadata, x.positions, hidden, next_ids, chosen, tables, x.kv_limits, x.max_kv_limit
        )

    def draft_tokens(
        self,
        md: AttentionMetadata,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        chosen: torch.Tensor,
        tables: torch.Tensor,
        limits: torch.Tensor,
        max_kv_limit: int | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MTP head over the step's tokens (writing its KV), then k drafts per sequence
        (S, k), into `out` if given: the first from the entry at the last verified position
        `chosen` (whose next token is the one just sampled), the others chaining the head on
        its own output one position further, writing KV into the row's lookahead slots
        (`limits`; rewritten once verified)."""
        h = self.first_pass(md, positions, hidden, next_ids)[chosen]
        if self.k == 1:  # no chain: skip its setup (two kernels a verify step)
            if out is None:
                return self.mtp.draft(h)[:, None]
            self.mtp.draft(h, out[:, 0])
            return out
        token = self.mtp.draft(h)
        drafts = [token]
        bs, num = self.block_size, chosen.shape[0]
        pos = positions[chosen]
        cu = torch.arange(num + 1, dtype=torch.int32, device=h.device)
        for _ in range(1, self.k):
            pos = pos + 1
            valid = pos < limits  # past the lookahead slots: write to the scratch slot
            p = torch.minimum(pos, limits - 1).clamp(min=0)
            col = (p // bs).clamp(max=tables.shape[1] - 1)[:, None]
            slots = tables.gather(1, col).squeeze(1).long() * bs + p % bs
            chain = AttentionMetadata(
                slot_mapping=torch.where(valid, slots, self.scratch_slot),
                block_tables=tables,
                cu_seqlens_q=cu,
                context_lens=(p + 1).to(torch.int32),
                query_lens_cpu=[1] * num,
                context_lens_cpu=[],
                max_context_len=max_kv_limit or 0,
                is_decode_only=True,
            )
            with forward_context(chain):
                h = self.mtp(token, h, pos.clamp(max=self.max_position), target_hidden=False)
            token = self.mtp.draft(h)
            drafts.append(token)
        return torch.stack(drafts, dim=1, out=out)
