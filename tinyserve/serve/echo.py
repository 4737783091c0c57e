"""vLLM's response extras of one request: `echo` (completions: the prompt, with its logprobs,
before each choice's text; with max_tokens 0 the prompt alone), `prompt_logprobs` (vLLM's list,
per choice in completions, per response in chat), `return_token_ids` and `continuous_usage_stats`.

ResponseBuilder calls `finish` on a whole response and `chunk` on each streamed chunk. The engine
hands a prompt's logprobs over once, with the first delta that carries a token of the prompt's
choice 0; until then a streamed echo of another choice waits (`feed` holds it back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinyserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from tinyserve.serve.responses import ResponseBuilder, _clamp

if TYPE_CHECKING:
    from tinyserve.serve.protocol import GenerateRequest


def extras_for(
    builder: ResponseBuilder,
    req: GenerateRequest,
    prompt_ids: list[list[int]],
    truncated: list[bool],
) -> Extras | None:
    """The request's Extras, or None when it asks for none of them."""
    wanted = req.echo or req.return_token_ids or req.continuous_usage
    if not wanted and req.params.prompt_logprobs is None:
        return None
    return Extras(builder, req, prompt_ids, truncated)


class Extras:
    def __init__(
        self,
        builder: ResponseBuilder,
        req: GenerateRequest,
        prompt_ids: list[list[int]],  # as run (after truncate_prompt_tokens)
        truncated: list[bool],  # prompt k lost tokens to truncate_prompt_tokens
    ) -> None:
        self.builder, self.req, self.n = builder, req, req.params.n
        self.prompt_ids = prompt_ids
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompt_ids)
        self.num_tokens = [0] * (len(prompt_ids) * self.n)  # per choice, for continuous usage
        self.started: set[int] = set()  # choices whose first chunk went out
        self.held: dict[int, list[tuple[int, CompletionOutput]]] = {}  # prompt k -> outputs
        # The echoed text: a text prompt as sent; token ids (or what truncation left) decoded.
        self.texts = [
            p if isinstance(p, str) and not cut else _decode(builder, ids)
            for p, ids, cut in zip(req.prompts or [], prompt_ids, truncated)
            if req.echo
        ]

    @property
    def echoes_logprobs(self) -> bool:
        return self.req.echo and self.builder.top_logprobs is not None

    # -- the engine's deltas ------------------------------------------------------------------

    def feed(self, k: int, delta: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Take prompt k's delta; return the (choice index, output) to stream now. A choice's
        first output waits while its echo needs prompt logprobs that have not come yet."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[k] = delta.prompt_logprobs
        outs = [(k * self.n + o.index, o) for o in delta.outputs]
        for i, o in outs:
            self.num_tokens[i] += len(o.token_ids)
        if not self.echoes_logprobs:
            return outs
        if self.prompt_logprobs[k] is None:
            self.held.setdefault(k, []).extend(outs)
            return []
        return self.held.pop(k, []) + outs

    def flush(self) -> list[tuple[int, CompletionOutput]]:
        """At the end of the stream, what still waits (prompt logprobs that never came: the
        request ended before its choice 0's first token)."""
        held = [out for k in sorted(self.held) for out in self.held[k]]
        self.held.clear()
        return held

    # -- bodies -------------------------------------------------------------------------------

    def finish(self, body: dict, choices: list[tuple[int, CompletionOutput]]) -> None:
        """A whole (non-streamed) response."""
        req = self.req
        for choice, (i, o) in zip(body["choices"], choices):
            k = i // self.n
            if not self.builder.chat:
                if req.echo:
                    self._echo(choice, i, k)
                if req.params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(k)
                if req.return_token_ids:
                    choice["prompt_token_ids"] = self.prompt_ids[k]
            if req.return_token_ids:
                choice["token_ids"] = o.token_ids
        if self.builder.chat and req.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        if self.builder.chat and req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids[0]

    def chunk(self, body: dict, choice: dict, token_ids: list[int] | None) -> None:
        """A streamed chunk of one choice (token_ids: its new tokens; None: chat's role chunk)."""
        i = choice["index"]
        k, first = i // self.n, i not in self.started
        self.started.add(i)
        if not self.builder.chat and self.req.echo:
            if first:
                self._echo(choice, i, k)
            elif self.req.echo_only:  # the token run for max_tokens 0 is not shown
                choice["text"], choice["logprobs"] = "", None
        if self.req.return_token_ids:
            if first:  # vLLM: the chat chunk's top level, a completion's choice
                (body if self.builder.chat else choice)["prompt_token_ids"] = self.prompt_ids[k]
            if token_ids is not None:
                choice["token_ids"] = token_ids
        if self.req.continuous_usage:
            num_prompt, num = len(self.prompt_ids[k]), self.num_tokens[i]
            body["usage"] = {
                "prompt_tokens": num_prompt,
                "completion_tokens": num,
                "total_tokens": num_prompt + num,
            }

    def _echo(self, choice: dict, i: int, k: int) -> None:
        """Put prompt k before choice i's text and logprobs (in place of them for echo_only);
        the logprobs' text offsets of what follows move past the prompt."""
        text = self.texts[k]
        choice["text"] = text if self.req.echo_only else text + choice["text"]
        if self.builder.top_logprobs is None:
            return
        ids = self.prompt_ids[k]
        entries = self.prompt_logprobs[k] or [None] * len(ids)
        echoed, end = self.builder.text_logprobs(ids, entries, 0)
        after = choice["logprobs"]
        if after is not None and not self.req.echo_only:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                echoed[key] += after[key]
            echoed["text_offset"] += [end + x for x in after["text_offset"]]
        choice["logprobs"] = echoed
        offsets = self.builder.text_offsets
        offsets[i] = offsets.get(i, 0) + end

    def _vllm_prompt_logprobs(self, k: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}}, the scored token first, then the top-k. A rank is known for the
        top-k (their order) and for the scored token when it is among them, else null."""
        entries = self.prompt_logprobs[k]
        if entries is None:
            return None
        num_top = self.req.params.prompt_logprobs or 0
        decode = self.builder._token_text
        out: list[dict[str, dict[str, Any]] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
            rank = {tid: r for r, (tid, _) in enumerate(ranked, 1)}
            out.append(
                {
                    str(tid): {
                        "logprob": _clamp(lp),
                        "rank": rank.get(tid),
                        "decoded_token": decode(tid),
                    }
                    for tid, lp in entry.items()
                }
            )
        return out


def _decode(builder: ResponseBuilder, ids: list[int]) -> str:
    if builder.tokenizer is None:  # a token-id-only model: its tokens' placeholders
        return "".join(map(builder._token_text, ids))
    return builder.tokenizer.decode(ids, skip_special_tokens=False)
