"""Speculative decoding: draft proposers and the verification rule (counted on the device by
kernels/spec_accept.py).

A decoding row carries k drafts d_1..d_k (from the MTP head or prompt lookup) and the target runs
its last token plus the drafts in one forward: k + 1 positions, each sampled like an ordinary
decode position (same per-position RNG counter, penalties seeing the drafts before it). Row j's
sample s_j is the target's token for the position after d_j. The row keeps d_1..d_a, where a is
the longest prefix with s_j == d_{j+1}, plus s_a (the bonus token when a == k).

That is rejection sampling with a point-mass draft q = delta(d): the draft is accepted with
probability p(d) (s == d), and on rejection the emitted s is distributed as p restricted to the
other tokens, i.e. normalize(max(p - q, 0)). Every emitted token is therefore distributed exactly
as without speculation, and since s_j uses the same RNG counter as the non-speculative step at
that position, seeded and greedy outputs are token-identical with speculation on or off.
Both proposers here draft deterministically (argmax / lookup), which is what this rule needs.

`Speculator` is what the engine and the runner ask of speculation, whatever the method: how many
drafts a row may carry, where they come from, how many were accepted, the counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.config import EngineConfig
from tinyserve.core.sequence import Sequence
from tinyserve.kernels.spec_accept import accept
from tinyserve.spec.ngram import NgramProposer


@dataclass(slots=True)
class SpecStats:
    """Global acceptance counters (server metrics read them)."""

    num_drafts: int = 0  # verify rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify row: accepted drafts + the target's own (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Speculative decoding for one engine: `ngram` drafts on the host from each row's tokens;
    `mtp` drafts on the device in the runner's forward (the engine only trims them to the room
    left). Both verify the same way (`accept`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.method = config.speculative_method
        self.k = config.num_speculative_tokens
        self.force_accept = config.spec_force_accept  # benchmarks only
        self.stats = SpecStats()
        # Host-side drafters (n-gram; tests plug in others); None: the runner's MTP head.
        self.proposer = NgramProposer(self.k) if self.method == "ngram" else None

    @property
    def drafts_on_device(self) -> bool:
        """Drafts need no host read of the accepted tokens, so the overlapped loop can run."""
        return self.proposer is None

    @property
    def lookahead(self) -> int:
        """KV slots a row reserves past its drafts: the MTP chain writes k - 1 of them."""
        return self.k - 1 if self.method == "mtp" else 0

    @property
    def keys_next_token(self) -> bool:
        """The MTP head's KV entry i reads token i + 1: a cached block needs its successor."""
        return self.method == "mtp"

    def num_drafts(self, seq: Sequence, max_model_len: int, in_flight: int = 0) -> int:
        """Drafts the next step may carry without passing max_tokens or max_model_len, when
        steps in flight may still accept up to `in_flight` drafts."""
        room = min(seq.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
        return max(0, min(self.k, room - 1 - in_flight))

    def next_drafts(self, seq: Sequence, device_drafts: list[int], max_model_len: int) -> list[int]:
        """The drafts the row's next step verifies: the proposer's, or the MTP head's."""
        num = self.num_drafts(seq, max_model_len)
        if num == 0:
            return []
        if self.proposer is not None:
            return self.proposer.propose(seq.token_ids)[:num]
        return device_drafts[:num]

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        self.stats.record(num_drafts, num_accepted)
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted

    def accept(
        self, sampled: torch.Tensor, draft_next: torch.Tensor, seg_starts: torch.Tensor
    ) -> torch.Tensor:
        """(S,) drafts each sampling sequence accepted, on the device (the rule above)."""
        return accept(sampled, draft_next, seg_starts, self.k + 1, self.force_accept)
