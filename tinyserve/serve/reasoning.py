"""Reasoning split: a thinking model's output -> (reasoning, answer), chunk by chunk.

With `--reasoning-parser qwen3 | deepseek_r1` the reasoning is the text inside `<think>...</think>`.
Where the output starts is read off the rendered prompt: a prompt ending in an open `<think>`
(Qwen3.5, DeepSeek-R1-0528) starts it inside the reasoning, one ending in a closed block (Qwen3's
`enable_thinking: false`) in the answer; otherwise the model may open the block itself (Qwen3), and
deepseek_r1 assumes it did (R1 may omit `<think>`). A tag split across tokens or detokenizer steps
is held back until it is whole, so streamed and whole outputs split alike. `OutputSplit` chains the
split and the tool-call parser: tool calls are read from the answer only.

`reasoning_params` turns where the output starts and a budget (Anthropic's `thinking.budget_tokens`,
vLLM's `thinking_token_budget`, OpenAI's `reasoning.effort` through `EFFORT_BUDGETS`) into the
engine's `SamplingParams.reasoning`: the budget forces `</think>`, and a JSON, choice or forced-tool
grammar applies after it.
"""

from __future__ import annotations

from tinyserve.model.tokenizer import Tokenizer
from tinyserve.outputs import CompletionOutput
from tinyserve.sampling_params import ReasoningParams, StructuredOutputsParams
from tinyserve.serve.tool_parser import ToolStreams, _partial_tail, extract_tool_calls

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"
# Where an output starts: inside the reasoning, in the answer, or at the model's choice.
REASONING, ANSWER, EITHER = "reasoning", "answer", "either"


def output_start(parser: str | None, prompt_text: str) -> str | None:
    """REASONING, ANSWER or EITHER for an output that follows `prompt_text`; None: no parser,
    the output is all answer."""
    if parser is None:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(OPEN):
        return REASONING
    if tail.endswith(CLOSE):
        return ANSWER  # thinking switched off in the template
    return REASONING if parser == "deepseek_r1" else EITHER


# Reasoning tokens per OpenAI `reasoning.effort` (the Responses API): fixed budgets, capped by
# max_tokens - 1; "none" switches thinking off in the template, "xhigh" sets no budget.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def effort_budget(effort: str | None, max_tokens: int | None) -> int | None:
    """The budget of a `reasoning.effort` (None: no budget)."""
    budget = EFFORT_BUDGETS.get(effort) if effort is not None else None
    if budget is not None and max_tokens is not None:
        budget = min(budget, max(0, max_tokens - 1))
    return budget


def reasoning_params(
    tokenizer: Tokenizer | None,
    start: str | None,
    budget: int | None,
    spec: StructuredOutputsParams | None,
    forced_tool: bool = False,
) -> tuple[str | None, ReasoningParams | None]:
    """(where the output starts, the engine's reasoning spec or None) for an output that starts
    at `start` (output_start), with a reasoning `budget` and a structured-outputs `spec`.

    A JSON schema, JSON object, choice or forced tool call applies after `</think>` when the
    prompt opened the reasoning; when the model may open it itself, the output is all answer
    (the grammar holds from the first token: the engine cannot start it after a reasoning that
    may never come). A regex or EBNF grammar may spell the tags itself: it covers the whole
    output, and no budget applies."""
    if start is None or start == ANSWER or tokenizer is None:
        return start, None
    json_like = spec is not None and (
        spec.json is not None or spec.json_object or spec.choice is not None or forced_tool
    )
    if spec is not None and not json_like:
        return start, None
    if json_like and start == EITHER:
        return ANSWER, None
    if budget is None and not json_like:
        return start, None  # nothing for the engine to do
    end_ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    if start == REASONING:
        return start, ReasoningParams(end_ids, budget)
    start_ids = tokenizer.encode(OPEN, add_special_tokens=False)
    return start, ReasoningParams(end_ids, budget, starts_in_reasoning=False, start_ids=start_ids)


class ReasoningParser:
    """One choice's text in, (reasoning, answer) out. A leading `<think>` (and the whitespace
    before it) is dropped, as is the whitespace right after `</think>`."""

    def __init__(self, start: str) -> None:
        self.state = start  # EITHER / REASONING: a leading <think> may still come
        self.at_start = start != ANSWER
        self.has_reasoning = start == REASONING
        self.after_close = False
        self._held = ""  # a tag that may be forming

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        text, self._held = self._held + text, ""
        if self.at_start:
            lead = text.lstrip()
            if lead.startswith(OPEN):
                text, self.has_reasoning = lead[len(OPEN) :], True
                self.state = REASONING
            elif not final and OPEN.startswith(lead):  # nothing yet, or the tag forming
                self._held = text
                return "", ""
            elif self.state == EITHER:
                self.state = ANSWER
            self.at_start = False
        reasoning = ""
        if self.state == REASONING:
            i = text.find(CLOSE)
            if i < 0:
                keep = 0 if final else _partial_tail(text, 0, CLOSE)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:i], text[i + len(CLOSE) :]
            self.state, self.after_close = ANSWER, True
        if self.after_close:  # "</think>\n\n" then the answer
            text = text.lstrip()
            self.after_close = not text
        return reasoning, text


def num_reasoning_tokens(tokenizer: Tokenizer | None, token_ids: list[int], opened: bool) -> int:
    """Tokens up to and with the one that completes `</think>`, all of them if it never came,
    none when the output had no reasoning (`opened` false). A binary search over decoded
    prefixes: whatever the tokenizer splits the tag into."""
    if not opened or tokenizer is None or not token_ids:
        return 0

    def closed(k: int) -> bool:
        return CLOSE in tokenizer.decode(token_ids[:k], skip_special_tokens=False)

    if not closed(len(token_ids)):
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # closed(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if closed(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class OutputSplit:
    """A response's outputs, per choice: reasoning split off (when a parser is on), then tool
    calls parsed from the answer (when tools were sent). `feed` streams, `whole` reads a whole
    output with the same parsers, so both agree."""

    def __init__(self, start: str | None, tools: ToolStreams | None, tokenizer: Tokenizer | None):
        self.start, self.tools, self.tokenizer = start, tools, tokenizer
        self.parsers: dict[int, ReasoningParser] = {}
        self.token_ids: dict[int, list[int]] = {}

    @property
    def has_reasoning(self) -> bool:
        return self.start is not None

    def feed(self, i: int, o: CompletionOutput) -> tuple[str, str, list[dict], str | None]:
        """Choice i's next output -> (reasoning, answer text, tool-call deltas, finish_reason)."""
        text, reasoning, calls, finish = o.text, "", [], o.finish_reason
        if self.start is not None:
            parser = self.parsers.setdefault(i, ReasoningParser(self.start))
            reasoning, text = parser.feed(text, final=finish is not None)
            self.token_ids.setdefault(i, []).extend(o.token_ids)
        if self.tools is not None:
            text, calls, finish = self.tools.feed(i, text, finish)
        return reasoning, text, calls, finish

    def whole(self, o: CompletionOutput) -> tuple[str | None, str | None, list[dict], str | None]:
        """A whole output -> (reasoning or None, answer or None, tool calls, finish_reason)."""
        reasoning, text, finish = None, o.text, o.finish_reason
        if self.start is not None:
            parser = ReasoningParser(self.start)
            r, text = parser.feed(text, final=True)
            reasoning = r if parser.has_reasoning else None
        calls = []
        if self.tools is not None:
            content, calls = extract_tool_calls(self.tools.form, text)
            if calls and finish == "stop":
                finish = "tool_calls"
            text = content
        return reasoning, text or None, calls, finish

    def num_reasoning_tokens(self, i: int, o: CompletionOutput | None = None) -> int:
        """Choice i's reasoning tokens: of the whole output `o`, else of what was streamed."""
        if self.start is None:
            return 0
        if o is None:
            parser, ids = self.parsers.get(i), self.token_ids.get(i, [])
            opened = parser is not None and parser.has_reasoning
        else:
            parser, ids = ReasoningParser(self.start), o.token_ids
            parser.feed(o.text, final=True)
            opened = parser.has_reasoning
        return num_reasoning_tokens(self.tokenizer, ids, opened)
