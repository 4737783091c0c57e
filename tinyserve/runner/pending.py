"""A launched step: its sampled ids on the device (the next step's inputs) and pinned host copies
of its results, read once its event has passed (the one host sync of a step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.sample.sampler import SamplingRow


@dataclass(slots=True)
class RowOutput:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class SeqOutput:
    """What one sampling sequence got from a step."""

    tokens: list[RowOutput]  # accepted drafts, then the target's own token
    draft_ids: list[int]  # the MTP head's drafts for the next step ([] without MTP)


@dataclass(slots=True)
class PromptScores:
    """A step's prompt logprobs (SamplingParams.prompt_logprobs): the logprob of each scored
    prompt token given those before it, and the top-k, in pinned host copies."""

    rows: list[tuple[int, int, int, int]]  # (batch row, first position, num, k) per chunk
    next_ids: list[int]  # (P,) the prompt token each position's logits score
    host: list[torch.Tensor | None]  # (P,) logprobs, (P, K) top ids, (P, K) top logprobs

    def entries(self) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """Batch row -> (first position p, per position {prompt token p + 1: logprob, then
        the row's top k}): vLLM's entry shape, the scored token first."""
        logprobs, top_ids, top_lps = (t.tolist() if t is not None else None for t in self.host)
        out, i = {}, 0
        for row, position, num, k in self.rows:
            entries = []
            for j in range(i, i + num):
                entry = {self.next_ids[j]: logprobs[j]}
                if k:
                    entry.update(zip(top_ids[j][:k], top_lps[j][:k]))
                entries.append(entry)
            out[row] = (position, entries)
            i += num
        return out


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device.type == "cpu":  # a copy still: `t` may be a view the next step overwrites
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class PendingStep:
    """A launched step: its sampled ids on the device (the next step's inputs) and pinned host
    copies of its results, readable once `event` has passed."""

    def __init__(
        self, seg_starts: list[int], rows: list[SamplingRow], sampled: torch.Tensor | None = None
    ) -> None:
        self.seg_starts, self.rows, self.sampled = seg_starts, rows, sampled
        # MTP steps, for the next step's inputs: (S,) first logits row and accepted drafts of
        # each sampling sequence (None: none accepted), (S, k) its drafts; all on the device.
        self.seg_dev: torch.Tensor | None = None
        self.accepted: torch.Tensor | None = None
        self.drafts: torch.Tensor | None = None
        self.host: list[torch.Tensor | None] = []
        self.prompt: PromptScores | None = None
        self.event: torch.cuda.Event | None = None
        self._outs: list[SeqOutput] | None = None

    def num_accepted(self) -> torch.Tensor:
        """(S,) drafts each sampling sequence accepted, on the device (zeros: no drafts)."""
        return self.accepted if self.accepted is not None else torch.zeros_like(self.seg_dev)

    def prompt_logprobs(self) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """PromptScores.entries of this step ({}: none scored); waits as `result` does."""
        if self.prompt is None:
            return {}
        if self.event is not None:
            self.event.synchronize()
        return self.prompt.entries()

    def result(self) -> list[SeqOutput]:
        """Per sampling sequence: its accepted drafts and token, and the MTP drafts (read once:
        the engine may ask early, for grammar matchers, and again to post-process)."""
        if not self.seg_starts:
            return []
        if self._outs is not None:
            return self._outs
        if self.event is not None:
            # NOTE: the one host sync of a step, in the engine's worker thread (never the loop).
            self.event.synchronize()
        tokens, accepted, drafts, logprobs, top_ids, top_lps = (
            t.tolist() if t is not None else None for t in self.host
        )
        num = len(self.seg_starts)
        accepted = accepted or [0] * num
        drafts = drafts or [[]] * num
        outs = []
        for first, n, drafted in zip(self.seg_starts, accepted, drafts):
            row_outs = []
            for r in range(first, first + n + 1):
                out = RowOutput(tokens[r])
                k = self.rows[r].params.logprobs
                if k is not None and logprobs is not None:
                    out.logprob = logprobs[r]
                    out.top_logprobs = list(zip(top_ids[r][:k], top_lps[r][:k])) if top_ids else []
                row_outs.append(out)
            outs.append(SeqOutput(row_outs, drafted))
        self._outs = outs
        return outs
