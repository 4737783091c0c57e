"""Request sampling parameters (vLLM names), validated when constructed.

Every field a client controls is range-checked here and raises `InvalidParameter`, whose `.param`
names the OpenAI field; checks that need the model (vocab size, context length) are the engine's.
No torch: the protocol, the scheduler's `Sequence` and the CLI import this without the sampler.
"""

from __future__ import annotations

import json as _json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

MAX_LOGPROBS = 20
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below this is greedy


class InvalidParameter(ValueError):
    """A client-controlled value is out of range; `.param` names the field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _invalid(param: str, allowed: str, value: object) -> InvalidParameter:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return InvalidParameter(param, f"{param} must be {allowed}, got {shown}")


def _real(param: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    # bool is an int subclass; `temperature=True` is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _invalid(param, allowed, value)
    try:
        x = float(value)
    except OverflowError:  # an int past float's range
        raise _invalid(param, allowed, value) from None
    if not math.isfinite(x) or not ok(x):
        raise _invalid(param, allowed, value)
    return x


def _int(param: str, value: object, allowed: str, ok: Callable[[int], bool]) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not ok(int(value)):
        raise _invalid(param, allowed, value)
    return int(value)


_REAL_RULES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "temperature": ("a finite number >= 0", lambda x: x >= 0),
    "top_p": ("a number in (0, 1]", lambda x: 0 < x <= 1),
    "min_p": ("a number in [0, 1]", lambda x: 0 <= x <= 1),
    "presence_penalty": ("a number in [-2, 2]", lambda x: -2 <= x <= 2),
    "frequency_penalty": ("a number in [-2, 2]", lambda x: -2 <= x <= 2),
    "repetition_penalty": ("a finite number > 0", lambda x: x > 0),
}
_INT_RULES: dict[str, tuple[str, Callable[[int], bool]]] = {
    "n": ("an integer >= 1", lambda x: x >= 1),
    "top_k": ("0 or -1 (off) or an integer >= 1", lambda x: x >= -1),
    "seed": ("an integer or null", lambda x: True),
    "max_tokens": ("an integer >= 1 or null", lambda x: x >= 1),
    "min_tokens": ("an integer in [0, max_tokens]", lambda x: x >= 0),
    "logprobs": (f"an integer in [0, {MAX_LOGPROBS}] or null", lambda x: 0 <= x <= MAX_LOGPROBS),
    # vLLM's -1 (the whole vocabulary) is refused as vLLM refuses it under its default
    # max_logprobs=20: a (prompt length, vocab) table to the host is no one's use.
    "prompt_logprobs": (
        f"an integer in [0, {MAX_LOGPROBS}] or null",
        lambda x: 0 <= x <= MAX_LOGPROBS,
    ),
}
_NULLABLE = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: the output must match exactly one of these. The engine compiles
    it (xgrammar, sample/grammar.py), so a schema, regex or grammar xgrammar rejects raises
    InvalidParameter there; the shapes are checked here."""

    json: dict | str | None = None  # a JSON schema, as a dict or as JSON text
    regex: str | None = None
    choice: list[str] | None = None  # one of these strings, verbatim
    grammar: str | None = None  # EBNF (GBNF) whose start rule is `root`
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON: no whitespace but the separators (vLLM's)

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidParameter(
                "structured_outputs",
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object (got {', '.join(kinds) or 'none'})",
            )
        param = f"structured_outputs.{kinds[0]}"
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError:
                raise _invalid(param, "a JSON schema (an object)", self.json) from None
        if self.json is not None and not isinstance(self.json, dict):
            raise _invalid(param, "a JSON schema (an object)", self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise _invalid(param, "a non-empty string", value)
        if self.choice is not None:
            ok = isinstance(self.choice, list | tuple) and self.choice
            if not ok or not all(isinstance(c, str) for c in self.choice):
                raise _invalid(param, "a non-empty list of strings", self.choice)
            self.choice = list(self.choice)
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise _invalid(f"structured_outputs.{name}", "a boolean", getattr(self, name))

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the grammar is compiled from, also the compile cache's key: ("json" or, without
        free whitespace, "json-compact", schema text) | ("regex", regex) | ("grammar", EBNF); a
        choice and json_object become one of these."""
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            # Property order is kept: xgrammar emits properties in the order the schema lists.
            text = _json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
            return ("json-compact" if self.disable_any_whitespace else "json", text)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:  # JSON string literals are EBNF string literals
            alternatives = " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice)
            return ("grammar", f"root ::= {alternatives}")
        return ("grammar", self.grammar)


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class ReasoningParams:
    """A thinking model's reasoning, as the engine sees it: token ids, no text. The reasoning
    ends where the output writes `end_ids` (`</think>` as the tokenizer encodes it). It starts at
    the output's first token (`starts_in_reasoning`: the prompt opened it), or, when the model
    opens it itself, after `start_ids` if the output begins with them (else there is none).

    `budget`: at most this many reasoning tokens (after the opener; a natural end's ids count),
    then the engine forces `end_ids`, one a step: the reasoning is exactly `budget` tokens and
    the end ids follow. A structured-outputs grammar applies from the token after the end on.
    """

    end_ids: list[int]
    budget: int | None = None  # None: no limit; 0: the end ids at once
    starts_in_reasoning: bool = True
    start_ids: list[int] | None = None  # only when not starts_in_reasoning

    def __post_init__(self) -> None:
        self.end_ids = _id_list("reasoning.end_ids", self.end_ids)
        if self.start_ids is not None:
            self.start_ids = _id_list("reasoning.start_ids", self.start_ids)
        if not isinstance(self.starts_in_reasoning, bool):
            raise _invalid("reasoning.starts_in_reasoning", "a boolean", self.starts_in_reasoning)
        if self.starts_in_reasoning and self.start_ids is not None:
            allowed = "null when the output starts in the reasoning"
            raise _invalid("reasoning.start_ids", allowed, self.start_ids)
        if self.budget is not None:
            self.budget = _int("reasoning.budget", self.budget, "an integer >= 0 or null", _nonneg)

    @property
    def ids(self) -> list[int]:
        return self.end_ids + (self.start_ids or [])


def _nonneg(x: int) -> bool:
    return x >= 0


def _id_list(param: str, ids: object) -> list[int]:
    ok = isinstance(ids, list | tuple) and ids
    if not ok or not all(
        not isinstance(i, bool) and isinstance(i, numbers.Integral) and i >= 0 for i in ids
    ):
        raise _invalid(param, "a non-empty list of token ids", ids)
    return [int(i) for i in ids]


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (normalized to 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    max_tokens: int | None = 16  # None: up to the context limit (the engine resolves it)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of each prompt token given those before it, plus the top-k (vLLM's; echo).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # The output must match a JSON schema / regex / choice / grammar (a dict: its fields).
    structured_outputs: StructuredOutputsParams | None = None
    # A thinking model's reasoning: its end, a budget, a grammar that starts after it.
    reasoning: ReasoningParams | None = None

    def __post_init__(self) -> None:
        _check_logit_bias(self)
        _check_reasoning(self)
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = set(so) - set(StructuredOutputsParams.__slots__)
            if unknown:
                raise _invalid("structured_outputs", "known fields only", sorted(unknown))
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise _invalid("structured_outputs", "a StructuredOutputsParams or a dict", so)
        for name, (allowed, ok) in _REAL_RULES.items():
            setattr(self, name, _real(name, getattr(self, name), allowed, ok))
        for name, (allowed, ok) in _INT_RULES.items():
            value = getattr(self, name)
            if value is not None or name not in _NULLABLE:
                setattr(self, name, _int(name, value, allowed, ok))
        self.top_k = max(self.top_k, 0)  # -1 and 0 both mean off
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", "an integer in [0, max_tokens]", self.min_tokens)
        self.stop = self._stop_list(self.stop)
        self.stop_token_ids = self._stop_token_id_list(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, "a boolean", getattr(self, name))

    @staticmethod
    def _stop_list(stop: object) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list | tuple) or not all(isinstance(s, str) and s for s in stops):
            raise _invalid("stop", "a non-empty string or a list of non-empty strings", stop)
        return list(stops)

    @staticmethod
    def _stop_token_id_list(ids: object) -> list[int]:
        ids = [] if ids is None else ids
        if not isinstance(ids, list | tuple) or not all(
            not isinstance(i, bool) and isinstance(i, numbers.Integral) and i >= 0 for i in ids
        ):
            raise _invalid("stop_token_ids", "a list of non-negative integers", ids)
        return [int(i) for i in ids]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_token_values(self) -> bool:
        """Penalties: sampling reads the values of the tokens generated so far."""
        penalties = self.presence_penalty or self.frequency_penalty
        return self.repetition_penalty != 1.0 or bool(penalties)

    @property
    def needs_output_count(self) -> bool:
        """Sampling that reads on the host how many tokens a row has emitted (the min_tokens stop
        mask): not known there while drafts are being verified. (The RNG counter moves on the
        device: runner/step_logits.py step_shift.)"""
        return self.min_tokens > 0


def _check_reasoning(p: SamplingParams) -> None:
    r = p.reasoning
    if isinstance(r, dict):
        unknown = set(r) - set(ReasoningParams.__slots__)
        if unknown:
            raise _invalid("reasoning", "known fields only", sorted(unknown))
        r = p.reasoning = ReasoningParams(**r)
    if r is not None and not isinstance(r, ReasoningParams):
        raise _invalid("reasoning", "a ReasoningParams or a dict", r)
    if r is not None and r.start_ids is not None and p.structured_outputs is not None:
        # Its first tokens would be unconstrained if the model did not open the reasoning.
        raise InvalidParameter(
            "structured_outputs",
            "structured outputs after a reasoning the model may or may not open are not "
            "supported: start the output in the reasoning or in the answer",
        )


def _check_logit_bias(p: SamplingParams) -> None:
    """Normalize logit_bias to {int id: float clamped to [-100, 100]}; ids < vocab are checked
    by the engine, which knows the vocabulary."""
    if p.logit_bias is None:
        return
    if not isinstance(p.logit_bias, dict):
        raise _invalid("logit_bias", "a dict of token id -> number", p.logit_bias)
    clean = {}
    for k, v in p.logit_bias.items():
        k = int(k) if isinstance(k, str) and k.isdigit() else k
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise _invalid("logit_bias", "keyed by non-negative token ids", k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _invalid("logit_bias", "finite numbers", v)
        clean[k] = min(100.0, max(-100.0, float(v)))  # OpenAI's range, clamped as vLLM does
    p.logit_bias = clean or None
