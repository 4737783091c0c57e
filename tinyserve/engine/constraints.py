"""What constrains a sequence's next token on the host (structured outputs' grammars, a reasoning
budget's forced end ids), and which step loop that allows.

The overlapped loop launches step N+1 before N's tokens reach the host. A grammar row still fits
it: once N+1's forward is enqueued, its matcher advances over N's token (`advance_early`) and
fills N+1's mask while that forward runs. What needs host decisions before a launch takes the
synchronous loop: token values (penalties), host drafts checked against a grammar, a grammar
gated by a reasoning phase, and a reasoning budget the steps in flight could spend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tinyserve.core.sequence import PLACEHOLDER, Sequence
from tinyserve.sample.grammar import GrammarState, StepBitmask, TokenBitmask
from tinyserve.sample.reasoning import ReasoningState
from tinyserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tinyserve.engine.requests import Request
    from tinyserve.runner.pending import PendingStep


class Constraints:
    """The engine's counts of what keeps the overlapped loop out (O(1) per step), and the masks
    of a step's constrained rows. Engine step thread only."""

    def __init__(
        self, requests: dict[str, Request], vocab_size: int, pin: bool, speculative: bool, k: int
    ) -> None:
        self.requests = requests  # the engine's live requests, by id
        self.speculative = speculative
        self.bitmask = StepBitmask(vocab_size, pin=pin)
        self.num_sync_requests = 0  # requests the overlapped loop cannot run
        self.num_grammars = 0  # requests with structured outputs
        # Sequences whose reasoning budget the steps in flight could spend: the end ids they
        # must then emit are host decisions, so the overlapped loop waits (`may_sync`).
        self.num_sync_seqs = 0
        self.sync_margin = 2 * (1 + k)  # tokens two overlapped steps may emit

    def needs_sync(self, p: SamplingParams) -> bool:
        # Drafts checked against a grammar, and a grammar after a reasoning phase, need the
        # matcher on the host before the launch.
        grammar = p.structured_outputs is not None and (self.speculative or p.reasoning is not None)
        return p.needs_token_values or grammar or (self.speculative and p.needs_output_count)

    def admit(self, req: Request) -> None:
        self.num_sync_requests += self.needs_sync(req.params)
        self.num_grammars += req.params.structured_outputs is not None
        for r in req.reasoning:
            self.may_sync(r)

    def release(self, req: Request) -> None:
        self.num_sync_requests -= self.needs_sync(req.params)
        self.num_grammars -= req.params.structured_outputs is not None
        self.num_sync_seqs -= sum(r.needs_sync for r in req.reasoning)

    @property
    def allow_overlap(self) -> bool:
        return self.num_sync_requests == 0 and self.num_sync_seqs == 0

    def may_sync(self, r: ReasoningState) -> None:
        """Keep `num_sync_seqs`: a sequence needs the synchronous loop while its budget has
        fewer tokens left than the step in flight and the next overlapped one may emit (then
        neither passes the budget, and the step after them is launched knowing whether to
        force), and while it forces the end."""
        left = r.num_left()
        needs = left is not None and left < self.sync_margin
        if needs != r.needs_sync:
            r.needs_sync = needs
            self.num_sync_seqs += 1 if needs else -1

    def masks(
        self, seqs: list[Sequence], last: PendingStep | None
    ) -> Callable[[], TokenBitmask | None] | None:
        """What fills the masks of a step sampling `seqs` (the runner calls it once the forward is
        enqueued), or None when no row can be constrained. `last`: the overlapped loop's step in
        flight, whose tokens the matchers take first."""
        if not (self.num_grammars or self.num_sync_requests or self.num_sync_seqs):
            return None
        if not any(s.params.structured_outputs or s.params.reasoning for s in seqs):
            return None

        def fill() -> TokenBitmask | None:
            if last is not None:
                self._advance_early(last, seqs)
            return self.bitmask.fill(seqs, self.constraint)

        return fill

    def _advance_early(self, last: PendingStep, seqs: list[Sequence]) -> None:
        """Advance the matchers of `seqs` over the tokens `last` sampled for them (still
        PLACEHOLDER on the host): waits for `last`, whose post-processing then reads the
        answers (`GrammarState.finishes_on`)."""
        outs = None
        for seq in seqs:
            req = self.requests[seq.request_id]
            if req.grammars and seq.token_ids[-1] == PLACEHOLDER:
                outs = outs or last.result()
                req.grammars[seq.index].advance_early(outs[seq.pending_row].tokens[0].token_id)

    def constraint(self, seq: Sequence) -> GrammarState | int | None:
        """What masks a sequence's next token: the end id it must emit, else its grammar once
        the reasoning (if any) ended and while it runs, else nothing (a grammar that ended on
        the step in flight: that row's token is dropped)."""
        req = self.requests[seq.request_id]
        if req.reasoning and not (r := req.reasoning[seq.index]).is_ended:
            return r.forced_token
        if req.grammars and not (g := req.grammars[seq.index]).done:
            return g
        return None

    def check_invariants(self) -> None:
        reqs = self.requests.values()
        assert self.num_sync_requests == sum(self.needs_sync(r.params) for r in reqs), "drift"
        assert self.num_grammars == sum(r.params.structured_outputs is not None for r in reqs)
        recount = sum(s.needs_sync for r in reqs for s in r.reasoning)
        assert self.num_sync_seqs == recount, "sync sequence count drifted"
