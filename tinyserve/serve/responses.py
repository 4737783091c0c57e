"""OpenAI response bodies and SSE chunks built from the engine's CompletionOutputs.

Chat: `chat.completion` / `chat.completion.chunk` (role first, then reasoning, then content,
finish_reason on the last chunk of each choice). Completions: `text_completion`. Logprobs follow
each API's own shape; -inf is clamped to -9999.0 (as vLLM) because JSON has no infinity. The
builder interface the request path drives (serve/generate.py): start, delta_chunk, finish,
error_event, close (streams), response (whole bodies).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tinyserve.model.tokenizer import Tokenizer
from tinyserve.outputs import CompletionOutput
from tinyserve.serve.reasoning import OutputSplit

if TYPE_CHECKING:
    from tinyserve.serve.echo import Extras
    from tinyserve.serve.errors import APIError

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class ResponseBuilder:
    """Builds the bodies of one request (chat or completion); ids and timestamps are fixed."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        created: int,
        model: str,
        tokenizer: Tokenizer,
        top_logprobs: int | None,
        include_usage: bool,
    ) -> None:
        self.chat, self.id, self.created, self.model = chat, request_id, created, model
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self.text_offsets: dict[int, int] = {}  # completions' logprobs.text_offset, per choice
        # chat: reasoning split off (--reasoning-parser), tool_calls parsed from the answer
        self.split: OutputSplit | None = None
        self.extras: Extras | None = None  # vLLM's echo, prompt_logprobs, token ids, usage

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- non-streaming ----------------------------------------------------------------------

    def response(self, choices: list[tuple[int, CompletionOutput]], use: dict) -> dict:
        if self.chat:
            body = self._head("chat.completion")
            body["choices"] = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": o.text},
                    "logprobs": self._logprobs(i, o),
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                for i, o in choices
            ]
        else:
            body = self._head("text_completion")
            body["choices"] = [
                {
                    "index": i,
                    "text": o.text,
                    "logprobs": self._logprobs(i, o),
                    "finish_reason": o.finish_reason,
                    "stop_reason": o.stop_reason,
                }
                for i, o in choices
            ]
        if self.split is not None:
            self._split(body["choices"], choices)
            if self.split.has_reasoning:
                num = sum(self.split.num_reasoning_tokens(i, o) for i, o in choices)
                use = use | {"completion_tokens_details": {"reasoning_tokens": num}}
        if self.extras is not None:
            self.extras.finish(body, choices)
        body["usage"] = use
        return body

    def _split(self, bodies: list[dict], choices: list[tuple[int, CompletionOutput]]) -> None:
        for body, (_, o) in zip(bodies, choices):
            reasoning, content, calls, body["finish_reason"] = self.split.whole(o)
            message = body["message"] = {"role": "assistant", "content": content}
            if self.split.has_reasoning:  # vLLM's name, and the older one
                message["reasoning"] = message["reasoning_content"] = reasoning
            elif content is None and not calls:
                message["content"] = ""
            if calls:
                message["tool_calls"] = calls

    # -- streaming ----------------------------------------------------------------------------

    def start(self, num_choices: int) -> bytes:
        if not self.chat:
            return b""
        return b"".join(self.role_chunk(i) for i in range(num_choices))

    def finish(self, use: dict) -> bytes:
        if not self.include_usage:
            return b""
        if self.split is not None and self.split.has_reasoning:
            num = sum(self.split.num_reasoning_tokens(i) for i in self.split.parsers)
            use = use | {"completion_tokens_details": {"reasoning_tokens": num}}
        return self.usage_chunk(use)

    def error_event(self, error: APIError) -> bytes:
        return sse(error.body)

    def close(self) -> bytes:
        return DONE

    def role_chunk(self, index: int) -> bytes:
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None)

    def delta_chunk(self, index: int, o: CompletionOutput) -> bytes:
        """One choice's step as an SSE chunk; b"" when there is nothing to tell. Reasoning goes
        in a chunk of its own, before the answer's."""
        logprobs = self._logprobs(index, o)
        reasoning, text, calls, finish_reason = "", o.text, None, o.finish_reason
        if self.split is not None:  # a call's text leaves as tool_calls deltas, never content
            reasoning, text, calls, finish_reason = self.split.feed(index, o)
        # Nothing to tell: text held back (a stop string may be forming, half a character).
        # A model without a tokenizer has no text at all: each step's chunk still goes out.
        tokenless = self.tokenizer is None and o.token_ids
        if not (text or calls) and finish_reason is None and logprobs is None and not tokenless:
            if not reasoning:
                return b""
            delta = {"reasoning": reasoning, "reasoning_content": reasoning}
            return self._chunk(index, delta, token_ids=o.token_ids)
        first = b""
        if reasoning:
            first = self._chunk(index, {"reasoning": reasoning, "reasoning_content": reasoning})
        delta = {"content": text} if (text or not self.chat) else {}
        if calls:
            delta["tool_calls"] = calls
        return first + self._chunk(
            index, delta, finish_reason, logprobs, o.stop_reason, o.token_ids
        )

    def _chunk(
        self, index, delta, finish_reason=None, logprobs=None, stop_reason=None, token_ids=None
    ) -> bytes:
        if self.chat:
            body = self._head("chat.completion.chunk")
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            body = self._head("text_completion")
            choice = {
                "index": index,
                "text": delta.get("content", ""),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        body["choices"] = [choice]
        if self.include_usage:
            body["usage"] = None
        if self.extras is not None:
            self.extras.chunk(body, choice, token_ids)
        return sse(body)

    def usage_chunk(self, use: dict) -> bytes:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = use
        return sse(body)

    # -- logprobs -----------------------------------------------------------------------------

    def _logprobs(self, index: int, o: CompletionOutput) -> dict | None:
        if self.top_logprobs is None or o.logprobs is None:
            return None
        decode = self._token_text
        k = self.top_logprobs
        if self.chat:
            content = []
            for tid, entry in zip(o.token_ids, o.logprobs):
                text = decode(tid)
                top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
                content.append(
                    {
                        "token": text,
                        "logprob": _clamp(entry[tid]),
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {
                                "token": (t := decode(i)),
                                "logprob": _clamp(lp),
                                "bytes": list(t.encode()),
                            }
                            for i, lp in top
                        ],
                    }
                )
            return {"content": content}
        offset = self.text_offsets.get(index, 0)
        logprobs, self.text_offsets[index] = self.text_logprobs(o.token_ids, o.logprobs, offset)
        return logprobs

    def text_logprobs(
        self, token_ids: list[int], entries: list[dict[int, float] | None], offset: int
    ) -> tuple[dict, int]:
        """The completions API's logprobs of these tokens, their text starting at `offset`, and
        the offset after them. An entry None (the prompt's first token, echoed) has no logprob;
        with logprobs=0 each top_logprobs holds the token itself (vLLM's shape)."""
        decode, k = self._token_text, self.top_logprobs
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = decode(tid)
            tokens.append(text)
            token_logprobs.append(None if entry is None else _clamp(entry[tid]))
            if entry is None:
                tops.append(None)
            else:
                top = sorted(entry.items(), key=lambda kv: -kv[1])[:k] if k else [(tid, entry[tid])]
                tops.append({decode(i): _clamp(lp) for i, lp in top})
            offsets.append(offset)
            offset += len(text)
        logprobs = {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return logprobs, offset

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:  # token-id-only model (dummy benchmark shapes)
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0) if logprob == logprob else -9999.0
