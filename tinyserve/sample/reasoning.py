"""A sequence's place in its reasoning (`SamplingParams.reasoning`): a thinking model's grammar
applies after the reasoning, and once the reasoning budget is spent the engine forces the
end-of-reasoning ids, each a one-bit row of the step's grammar mask (sample/grammar.py)."""

from __future__ import annotations

from tinyserve.sampling_params import ReasoningParams


class ReasoningState:
    """One sequence's place in its reasoning (`SamplingParams.reasoning`), advanced token by
    verified token: OPENING (the model may open it: the start ids matched so far), THINKING
    (`num_tokens` counted, the budget not spent), FORCING (the end ids, `num_forced` of them
    emitted), ENDED (the answer: a grammar applies from here). Engine step thread only."""

    __slots__ = ("spec", "phase", "num_tokens", "num_forced", "num_opened", "needs_sync", "_recent")

    OPENING, THINKING, FORCING, ENDED = range(4)

    def __init__(self, spec: ReasoningParams) -> None:
        self.spec = spec
        self.num_tokens = self.num_forced = self.num_opened = 0
        self.phase = self.ENDED
        self._recent: list[int] = []  # the last reasoning tokens, as many as end_ids
        self.needs_sync = False  # kept by engine/constraints.py (Constraints.may_sync)
        if spec.starts_in_reasoning:
            self._think()
        elif spec.start_ids:
            self.phase = self.OPENING

    @property
    def is_ended(self) -> bool:
        return self.phase == self.ENDED

    @property
    def forced_token(self) -> int | None:
        """The token the next step must emit, while forcing the end."""
        return self.spec.end_ids[self.num_forced] if self.phase == self.FORCING else None

    def num_left(self) -> int | None:
        """Reasoning tokens the budget still allows (None: no limit, or not reasoning)."""
        budget = self.spec.budget
        if budget is None or self.phase == self.ENDED:
            return None
        return 0 if self.phase == self.FORCING else budget - self.num_tokens

    def advance(self, token: int) -> None:
        """A verified token (a no-op once ended)."""
        spec = self.spec
        if self.phase == self.OPENING:
            if token == spec.start_ids[self.num_opened]:
                self.num_opened += 1
                if self.num_opened == len(spec.start_ids):
                    self._think()
            else:
                self.phase = self.ENDED  # the model answered without reasoning
        elif self.phase == self.THINKING:
            self.num_tokens += 1
            end = spec.end_ids
            self._recent = (self._recent + [token])[-len(end) :]
            if self._recent == end:
                self.phase = self.ENDED
            elif spec.budget is not None and self.num_tokens >= spec.budget:
                self.phase = self.FORCING
        elif self.phase == self.FORCING:
            assert token == self.forced_token, "a forced token was not emitted"
            self.num_forced += 1
            if self.num_forced == len(spec.end_ids):
                self.phase = self.ENDED

    def _think(self) -> None:
        self.phase = self.THINKING if self.spec.budget != 0 else self.FORCING

    def trim_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts this step may carry: none while opening or forcing; within the budget (the
        step emits up to one token past its drafts), and none that completes the end (the rows
        after it would be the answer's, which a grammar masks)."""
        if self.phase == self.ENDED or not drafts:
            return drafts
        if self.phase != self.THINKING:
            return []
        left = self.num_left()
        if left is not None:
            drafts = drafts[: max(0, left - 1)]
        end = self.spec.end_ids
        for j in range(len(drafts)):
            if (self._recent + drafts[: j + 1])[-len(end) :] == end:
                return drafts[:j]
        return drafts
