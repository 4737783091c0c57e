"""OpenAI request validation: JSON bodies -> (prompts, SamplingParams), or an `APIError`.

Everything a client controls is checked here before any tokenizer or engine work: types, ranges,
caps (n, stop, logprobs, logit_bias, prompts), and a character-count guard that rejects prompts
that cannot fit the context without tokenizing them. Errors carry OpenAI's `param` and `code`.
The parsers compose the per-field validators of serve/fields.py; the errors are serve/errors.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tinyserve.sampling_params import MAX_LOGPROBS, InvalidParameter, SamplingParams
from tinyserve.serve import fields, structured
from tinyserve.serve.errors import APIError, bad, unsupported
from tinyserve.serve.tools import ToolRequest

MAX_N = 16  # choices per prompt; each one is a sequence in the batch
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]

# Sampling fields passed straight to SamplingParams, which range-checks them (vLLM names).
_SAMPLING_KEYS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "prompt_logprobs",
)
# The real-valued ones: SamplingParams calls float() on them, which an integer past ~1.8e308
# (JSON allows 400 digits) overflows.
_REAL_KEYS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(slots=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    names: tuple[str, ...]  # accepted `model` values; names[0] is reported in responses
    max_model_len: int
    vocab_size: int
    # The longest vocabulary entry in characters: a text of C characters is at least
    # C / max_token_chars tokens (byte-level BPE: one char per byte), so longer texts are
    # rejected before the tokenizer runs.
    max_token_chars: int
    # Request defaults from the checkpoint's generation_config.json (vLLM's --generation-config):
    # sampling fields a request leaves unset, and `max_tokens`, a cap when it sets none.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class GenerateRequest:
    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: no logprobs; else entries per token (0 = sampled only)
    messages: list[dict[str, str]] | None = None  # chat
    prompts: list[str | list[int]] | None = None  # completions: text or token ids
    max_tokens_param: str = "max_tokens"  # the field the client used, named in errors
    cache_salt: str | None = None  # vLLM's per-tenant prefix-cache isolation
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls
    # The field params.structured_outputs came from, named in its errors (serve/structured.py).
    structured_param: str = "structured_outputs"
    # vLLM's extras (responses: serve/echo.py)
    echo: bool = False  # completions: the prompt, with its logprobs, before each completion
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (lm-eval's loglikelihood)
    return_token_ids: bool = False  # prompt_token_ids and each choice's token_ids
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on each chunk
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: the context)
    truncation_side: str = "left"  # left: keep the last ones; right: the first ones
    # Chat template switches (add_generation_prompt, continue_final_message) and
    # chat_template_kwargs: serve/chat_template.py.
    render_options: dict[str, Any] = field(default_factory=dict)
    # Reasoning tokens before `</think>` is forced (vLLM's thinking_token_budget; /v1/messages'
    # thinking.budget_tokens and /v1/responses' reasoning.effort map onto it): serve/reasoning.py.
    reasoning_budget: int | None = None


def parse_chat(body: Any, info: ModelInfo) -> GenerateRequest:
    body = fields.json_object(body)
    logprobs = fields.optional(body, "logprobs", bool, "a boolean")
    top = fields.optional(body, "top_logprobs", int, f"an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]")
    if top is not None and not logprobs:
        raise bad("top_logprobs", "top_logprobs requires logprobs to be true")
    truncated = body.get("truncate_prompt_tokens") is not None  # then any length may come
    messages = fields.messages(body.get("messages"), info, check_chars=not truncated)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    req = _common(body, info, key or "max_tokens", (top or 0) if logprobs else None)
    req.messages = messages
    req.render_options = fields.render_options(body)
    budget = fields.optional(body, "thinking_token_budget", int, "an integer >= 0 or null")
    if budget is not None and budget < 0:
        raise bad("thinking_token_budget", "thinking_token_budget must be an integer >= 0")
    req.reasoning_budget = budget
    _extras(req, body, info)
    _structured(req, body, chat=True)
    return req


def _structured(req: GenerateRequest, body: dict, chat: bool) -> None:
    try:
        structured.apply(req, body, chat)
    except InvalidParameter as e:
        raise bad(e.param, str(e)) from None


def parse_completion(body: Any, info: ModelInfo) -> GenerateRequest:
    body = fields.json_object(body)
    echo = bool(fields.optional(body, "echo", bool, "a boolean"))
    if body.get("suffix") is not None:
        raise unsupported("suffix", "suffix")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise unsupported("best_of", "best_of > n")
    logprobs = fields.optional(body, "logprobs", int, f"an integer in [0, {MAX_LOGPROBS}] or null")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null")
    truncated = body.get("truncate_prompt_tokens") is not None  # then any length may come
    prompts = fields.prompts(body.get("prompt"), info, check_chars=not truncated)
    run_body, echo_only = _completion_defaults(body, echo, logprobs)
    req = _common(run_body, info, "max_tokens", logprobs)
    req.prompts = prompts
    req.echo, req.echo_only = echo, echo_only
    _extras(req, body, info)
    _structured(req, body, chat=False)
    return req


def _completion_defaults(body: dict, echo: bool, logprobs: int | None) -> tuple[dict, bool]:
    """vLLM's completions defaults: max_tokens 16 when unset; echo with max_tokens 0 runs one
    token and answers with the prompt alone (echo_only); echo's logprobs cover the prompt too
    (prompt_logprobs = logprobs). Returns the body to run and echo_only."""
    body, max_tokens = dict(body), body.get("max_tokens")
    echo_only = echo and type(max_tokens) is int and max_tokens == 0
    if max_tokens is None or echo_only:
        body["max_tokens"] = 1 if echo_only else 16
    if echo and logprobs is not None and body.get("prompt_logprobs") is None:
        body["prompt_logprobs"] = logprobs
    return body, echo_only


def _extras(req: GenerateRequest, body: dict, info: ModelInfo) -> None:
    """vLLM's extras of both APIs: return_token_ids, stream_options.continuous_usage_stats,
    truncate_prompt_tokens / truncation_side; prompt_logprobs (> 0) are not streamed."""
    req.return_token_ids = bool(fields.optional(body, "return_token_ids", bool, "a boolean"))
    options = body.get("stream_options") or {}  # an object: _common checked it
    every = fields.optional(options, "continuous_usage_stats", bool, "a boolean", "stream_options")
    req.continuous_usage = bool(every) and req.include_usage
    if req.stream and (req.params.prompt_logprobs or 0) > 0 and body.get("prompt_logprobs"):
        raise bad("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    limit = info.max_model_len
    keep = fields.optional(body, "truncate_prompt_tokens", int, f"-1 or an integer in [1, {limit}]")
    if keep is not None and not (keep == -1 or 1 <= keep <= limit):
        raise bad(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 (the context length) or an integer in "
            f"[1, {limit}] (max_model_len)",
        )
    req.truncate_prompt_tokens = limit if keep == -1 else keep
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise bad("truncation_side", "truncation_side must be 'left' or 'right'")
    req.truncation_side = side or "left"


def _common(body: dict, info: ModelInfo, max_key: str, top: int | None) -> GenerateRequest:
    model = body.get("model")
    if model is None:
        model = info.names[0]
    elif not isinstance(model, str):
        raise bad("model", "model must be a string")
    elif model not in info.names:
        shown = model if len(model) <= 64 else model[:61] + "..."
        raise APIError(404, f"The model {shown!r} does not exist.", "model", "model_not_found")
    stream = fields.optional(body, "stream", bool, "a boolean") or False
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    include_usage = fields.optional(
        options or {}, "include_usage", bool, "a boolean", "stream_options"
    )
    n = body.get("n", 1)
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise bad("n", f"n must be at most {MAX_N}")  # before anything is allocated
    fields.check_logit_bias(body.get("logit_bias"), info.vocab_size)
    for key in _REAL_KEYS:
        if not fields.fits_float(body.get(key)):
            raise bad(key, f"{key} must be a finite number")
    kwargs = {k: body[k] for k in _SAMPLING_KEYS if k in body}
    fields.check_seed(body.get("seed"))
    for key, value in info.sampling_defaults.items():  # what the request leaves unset
        if key != "max_tokens" and body.get(key) is None:
            kwargs[key] = value
    if body.get("logit_bias"):
        kwargs["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
    if max_key in body:
        kwargs["max_tokens"] = body[max_key]
    else:
        kwargs["max_tokens"] = None  # chat: up to the context limit (check_context)
    kwargs["stop"] = fields.stop(body.get("stop"))
    kwargs["stop_token_ids"] = fields.stop_token_ids(body.get("stop_token_ids"), info.vocab_size)
    try:
        params = SamplingParams(**kwargs, logprobs=top)
    except InvalidParameter as e:
        param = {"max_tokens": max_key, "logprobs": "top_logprobs" if top else "logprobs"}
        raise bad(param.get(e.param, e.param), str(e).replace("max_tokens", max_key)) from None
    if params.temperature > MAX_TEMPERATURE:
        raise bad("temperature", f"temperature must be a number in [0, {MAX_TEMPERATURE}]")
    salt = fields.optional(body, "cache_salt", str, "a string")
    if salt is not None and not 0 < len(salt) <= 256:
        raise bad("cache_salt", "cache_salt must be a non-empty string of at most 256 characters")
    return GenerateRequest(
        model,
        params,
        stream,
        bool(include_usage),
        top,
        max_tokens_param=max_key,
        cache_salt=salt,
    )


def check_context(
    num_prompt_tokens: int, req: GenerateRequest, info: ModelInfo, clamp: bool
) -> SamplingParams:
    """OpenAI's context check on the tokenized prompt; returns the params to run with."""
    params, limit = req.params, info.max_model_len
    room = limit - num_prompt_tokens
    cap = info.sampling_defaults.get("max_tokens")  # unset max_tokens: vLLM's min(cap, room)
    if params.max_tokens is None and cap is not None and room > 0:
        num = min(cap, room)
        return replace(params, max_tokens=num, min_tokens=min(params.min_tokens, num))
    if room > 0 and (params.max_tokens is None or params.max_tokens <= room):
        return params
    if clamp and room > 0:
        return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
    asked = params.max_tokens or 0
    raise bad(
        req.max_tokens_param if room > 0 else ("messages" if req.messages else "prompt"),
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the messages, {asked} in "
        f"the completion). Please reduce the length of the messages or completion.",
        "context_length_exceeded",
    )


def truncate_prompt(ids: list[int], req: GenerateRequest) -> list[int]:
    """truncate_prompt_tokens: the last (truncation_side left) or first N prompt tokens."""
    keep = req.truncate_prompt_tokens
    if keep is None or len(ids) <= keep:
        return ids
    return ids[-keep:] if req.truncation_side == "left" else ids[:keep]


def parse_tokenize(
    body: Any, info: ModelInfo
) -> tuple[str | list[dict[str, Any]], bool, dict[str, Any]]:
    """/tokenize: {"prompt": str} or {"messages": [...]} -> (text or messages, add_special,
    the chat template's switches and kwargs: render_options)."""
    body = fields.json_object(body)
    add_special = fields.optional(body, "add_special_tokens", bool, "a boolean")
    if "messages" in body:
        return (
            fields.messages(body["messages"], info),
            bool(add_special),
            fields.render_options(body),
        )
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string (or send messages)")
    fields.check_num_chars(len(prompt), info, "prompt")
    return prompt, add_special is not False, {}


def parse_detokenize(body: Any, info: ModelInfo) -> list[int]:
    tokens = fields.json_object(body).get("tokens")
    if not isinstance(tokens, list) or not fields.is_ids(tokens):
        raise bad("tokens", "tokens must be a list of token ids")
    if len(tokens) > info.max_model_len or not all(0 <= t < info.vocab_size for t in tokens):
        raise bad(
            "tokens", f"tokens must be at most {info.max_model_len} ids in [0, {info.vocab_size})"
        )
    return tokens
