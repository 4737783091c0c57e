"""Per-field validators of the API bodies: each takes one client-controlled JSON value (and the
served model's limits) and returns it checked or normalized, or raises a 400 `APIError` that names
the field. They know nothing of the request they belong to: protocol.py's parsers compose them
(imports point protocol -> fields -> errors). Caps here are OpenAI's where it has one.
"""

from __future__ import annotations

import numbers
import re
from typing import TYPE_CHECKING, Any

from tinyserve.sampling_params import InvalidParameter
from tinyserve.serve import chat_template
from tinyserve.serve.errors import bad
from tinyserve.serve.tools import message_fields

if TYPE_CHECKING:
    from tinyserve.serve.protocol import ModelInfo

MAX_PROMPTS = 16  # prompts in one /v1/completions batch
MAX_STOP = 4  # OpenAI's cap
MAX_STOP_CHARS = 256  # the detokenizer holds back up to this many characters while streaming
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's cap
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_ROLE_CHARS = 64
_INT_KEY = re.compile(r"-?[0-9]{1,12}")


def json_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    return body


def optional(body: dict, key: str, kind: type, allowed: str, param: str | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise bad(param or key, f"{key} must be {allowed}")
    return value


def check_seed(seed: Any) -> None:
    """vLLM's range: a 64-bit signed integer (the engine keeps 63 bits of it)."""
    if isinstance(seed, int) and not isinstance(seed, bool) and not -(2**63) <= seed < 2**63:
        raise bad("seed", "seed must be an integer in [-2**63, 2**63 - 1]")


def fits_float(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            return False
    return True


def render_options(body: dict) -> dict[str, Any]:
    """The chat template's switches and chat_template_kwargs (serve/chat_template.py)."""
    try:
        return chat_template.render_options(body)
    except InvalidParameter as e:
        raise bad(e.param, str(e)) from None


def messages(value: Any, info: ModelInfo, check_chars: bool = True) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty list of messages")
    out, num_chars = [], 0
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not _is_role(m.get("role")):
            # Any role the chat template accepts (vLLM's custom roles); ROLES are OpenAI's.
            raise bad(
                "messages",
                f"messages[{i}] must be an object with a role: a string of 1 to "
                f"{MAX_ROLE_CHARS} characters such as {', '.join(ROLES)}",
            )
        try:
            extra = message_fields(m, i)  # tool_calls, tool_call_id
        except InvalidParameter as e:
            raise bad(e.param, str(e)) from None
        # An assistant's reasoning, for templates that render it (Qwen3's reasoning_content).
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None and (m["role"] != "assistant" or not isinstance(reasoning, str)):
            raise bad("messages", f"messages[{i}].reasoning_content must be a string, on assistant")
        if reasoning is not None:
            extra["reasoning_content"] = reasoning
        # A tool call (or a reasoning) may come without content, a tool's result may be empty.
        unsaid = {"tool_calls", "reasoning_content"} & extra.keys() or m["role"] == "tool"
        empty = m.get("content") in (None, "") and unsaid
        content = "" if empty else _content(m.get("content"), i)
        msg = {"role": m["role"], "content": content, **extra}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        num_chars += len(content) + len(reasoning or "")
        out.append(msg)
    if check_chars:
        check_num_chars(num_chars, info, "messages")
    return out


def _is_role(role: Any) -> bool:
    return isinstance(role, str) and 0 < len(role) <= MAX_ROLE_CHARS


def _content(content: Any, i: int) -> str:
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise bad("messages", f"messages[{i}].content: a text part needs a string text")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str) or not content:
        raise bad("messages", f"messages[{i}].content must be a non-empty string")
    return content


def prompts(value: Any, info: ModelInfo, check_chars: bool = True) -> list[str | list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and is_ids(value)):
        prompts = [value]
    elif isinstance(value, list) and value and len(value) <= MAX_PROMPTS:
        prompts = value
    else:
        raise bad(
            "prompt",
            f"prompt must be a non-empty string, token ids, or a list of up to "
            f"{MAX_PROMPTS} of either",
        )
    for p in prompts:
        if isinstance(p, str) and p:
            if check_chars:
                check_num_chars(len(p), info, "prompt")
        elif not (isinstance(p, list) and p and is_ids(p)):
            raise bad("prompt", "each prompt must be a non-empty string or list of token ids")
        elif not all(0 <= t < info.vocab_size for t in p):
            raise bad("prompt", f"token ids must be in [0, {info.vocab_size})")
    return prompts


def is_ids(value: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_num_chars(num_chars: int, info: ModelInfo, param: str) -> None:
    """The tokenizer-cost guard: reject text that must exceed the context, without encoding it."""
    at_least = num_chars // info.max_token_chars
    if at_least > info.max_model_len:
        raise bad(
            param,
            f"This model's maximum context length is {info.max_model_len} tokens. However, your "
            f"{param} ({num_chars} characters) resulted in more than {at_least} tokens. Please "
            f"reduce the length of the {param}.",
            "context_length_exceeded",
        )


def stop(value: Any) -> list[str] | None:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return None
    if not isinstance(stops, list) or len(stops) > MAX_STOP:
        raise bad("stop", f"stop must be a string or a list of at most {MAX_STOP} strings")
    if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return stops


def stop_token_ids(value: Any, vocab_size: int) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS or not is_ids(value):
        raise bad(
            "stop_token_ids",
            f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
        )
    if not all(0 <= t < vocab_size for t in value):
        raise bad("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size})")
    return value


def check_logit_bias(value: Any, vocab_size: int) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise bad(
            "logit_bias",
            f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]",
        )
    bad_keys = [
        k
        for k, v in value.items()
        if not (_INT_KEY.fullmatch(k) and 0 <= int(k) < vocab_size)
        or isinstance(v, bool)
        or not isinstance(v, numbers.Real)
        or not -100 <= v <= 100  # NaN compares False; an int of any size compares exactly
    ]
    if bad_keys:
        shown = ", ".join(repr(k if len(k) <= 16 else k[:13] + "...") for k in bad_keys)
        raise bad(
            "logit_bias",
            f"invalid logit_bias entries (keys must be token ids in "
            f"[0, {vocab_size}), values numbers in [-100, 100]): {shown}",
        )
