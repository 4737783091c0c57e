"""What the engine hands back: vLLM-shaped RequestOutput / CompletionOutput.

The engine emits deltas (only the new tokens and text of each step); `merge` folds them into the
cumulative form that `LLM.generate` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One entry per generated token: {token_id: logprob} for the sampled token and the top-k.
Logprobs = list[dict[int, float]]
# One entry per prompt token: {its id: log P(token i | tokens < i), then the top-k}; the first
# token has no context, so its entry is None (vLLM's and OpenAI's echo shape).
PromptLogprobs = list[dict[int, float] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # Speculative decoding, over the request's sequences so far: drafts proposed / accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.prompt_logprobs: the whole prompt's, on one delta only (the first that
    # carries a token of completion 0), None on the others.
    prompt_logprobs: PromptLogprobs | None = None

    def merge(self, delta: RequestOutput) -> None:
        """Fold a step's delta into this cumulative output."""
        by_index = {o.index: o for o in self.outputs}
        for d in delta.outputs:
            o = by_index.get(d.index)
            if o is None:
                o = by_index[d.index] = CompletionOutput(d.index)
                self.outputs.append(o)
                self.outputs.sort(key=lambda c: c.index)
            o.text += d.text
            o.token_ids += d.token_ids
            if d.logprobs is not None:
                o.logprobs = (o.logprobs or []) + d.logprobs
            o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_draft_tokens = delta.num_draft_tokens
        self.num_accepted_tokens = delta.num_accepted_tokens
