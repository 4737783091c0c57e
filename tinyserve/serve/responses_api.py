"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) as a thin
translation: the body becomes a chat body that `protocol.parse_chat` validates (one parameter
mapping), runs down the one request path (serve/generate.py), and `ResponsesBuilder` turns the
outputs into output items (reasoning, message, function_call) and the typed stream events in their
documented order. `store` keeps the conversation for `previous_response_id`
(serve/response_store.py).

Errors keep OpenAI's shape, naming this API's fields (input, max_output_tokens, text.format).
Beyond OpenAI's fields, vLLM's sampling extras (top_k, seed, structured_outputs, ...) pass through.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tinyserve.serve import generate, protocol
from tinyserve.serve.errors import APIError, bad, unsupported
from tinyserve.serve.middleware import credential, json_response, read_json
from tinyserve.serve.protocol import GenerateRequest
from tinyserve.serve.reasoning import effort_budget
from tinyserve.serve.response_store import scope_of
from tinyserve.serve.responses_output import ResponsesBuilder
from tinyserve.serve.state import STATE, ServerState

MAX_ITEMS = 2048
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ROLES = ("user", "assistant", "system", "developer")
# The chat field an error names -> this API's.
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
# vLLM's sampling extras, passed to the chat body as they are.
EXTRAS = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "structured_outputs",
    "cache_salt",
    "skip_special_tokens",
)


@dataclass(slots=True)
class Turn:
    """One request: the chat request it became and what the response echoes or stores."""

    req: GenerateRequest
    echo: dict[str, Any]  # request fields the response object repeats
    history: list[dict]  # the conversation (without instructions), chat-shaped, for the store
    store: bool
    scope: str


def parse(body: Any, st: ServerState, scope: str) -> Turn:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    for key, what in [("background", "background mode"), ("conversation", "conversation")]:
        if body.get(key) not in (None, False):
            raise unsupported(key, what)
    if body.get("prompt") is not None:
        raise unsupported("prompt", "prompt templates")
    if body.get("top_logprobs") not in (None, 0):
        raise unsupported("top_logprobs", "top_logprobs")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad("truncation", 'truncation must be "auto" or "disabled"')
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad("store", "store must be a boolean")
    history = _previous(body.get("previous_response_id"), st, scope)
    known = {c["id"] for m in history for c in m.get("tool_calls", [])}
    new = input_messages(body.get("input"), known)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat = {k: body[k] for k in EXTRAS if k in body}
    chat |= {k: body[k] for k in ("model", "temperature", "top_p", "stream") if k in body}
    chat["messages"] = system + history + new
    chat["max_tokens"] = body.get("max_output_tokens")
    chat["tools"] = _tools(body.get("tools"))
    chat["tool_choice"] = _tool_choice(body.get("tool_choice"))
    chat["parallel_tool_calls"] = body.get("parallel_tool_calls")
    chat["response_format"] = _text_format(body.get("text"))
    chat["chat_template_kwargs"] = _template_kwargs(body)
    effort = (body.get("reasoning") or {}).get("effort")  # a valid one: checked just above
    limit = body.get("max_output_tokens")  # parse_chat checks it; here only an int caps
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    chat["thinking_token_budget"] = effort_budget(effort, limit)
    try:
        req = protocol.parse_chat(chat, st.info)
    except APIError as e:
        raise renamed(e) from None
    req.max_tokens_param = "max_output_tokens"
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16):
        raise bad("metadata", "metadata must be an object of at most 16 keys")
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {},
        "parallel_tool_calls": req.tools.parallel if req.tools is not None else True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "temperature": req.params.temperature,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if req.tools else "none"),
        "tools": body.get("tools") or [],
        "top_p": req.params.top_p,
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return Turn(req, echo, history + new, store, scope)


def renamed(e: APIError) -> APIError:
    """An error of the chat translation, naming this API's field."""
    if e.param in PARAMS:
        e.param = PARAMS[e.param]
        e.message = e.message.replace("messages", "input")
        e.message = e.message.replace("max_tokens", "max_output_tokens")
    return e


def _previous(response_id: Any, st: ServerState, scope: str) -> list[dict]:
    if response_id is None:
        return []
    if not isinstance(response_id, str):
        raise bad("previous_response_id", "previous_response_id must be a string")
    entry = st.store.get(scope, response_id)
    if entry is None:
        shown = response_id if len(response_id) <= 64 else response_id[:61] + "..."
        raise APIError(
            404, f"No response with id {shown!r} is stored.", "previous_response_id", "not_found"
        )
    return [dict(m) for m in entry.messages]


def input_messages(value: Any, known_calls: set[str]) -> list[dict]:
    """`input` (a string, or a list of items) -> chat messages. `known_calls`: call ids that a
    function_call_output may answer (grows with this input's function_call items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value or len(value) > MAX_ITEMS:
        raise bad("input", f"input must be a string or a list of 1 to {MAX_ITEMS} items")
    out: list[dict] = []
    reasoning = None  # a reasoning item's text, for the assistant turn that follows
    for j, item in enumerate(value):
        where = f"input[{j}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad("input", f"{where}.role must be one of {', '.join(ROLES)}")
            msg = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call_id, name, args = (item.get(k) for k in ("call_id", "name", "arguments"))
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise bad(
                    "input", f"{where}: a function_call needs string call_id, name, arguments"
                )
            known_calls.add(call_id)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_calls:
                raise bad("input", f"{where}: call_id matches no function_call before it")
            content = _text(item.get("output"), where, allow_empty=True)
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        else:
            shown = str(kind)[:64] if kind is not None else "not an object"
            raise bad("input", f"{where}: unsupported item type {shown!r}")
    return out


def _text(content: Any, where: str, allow_empty: bool = False) -> str:
    """A message's content: a string or text parts (input_text, output_text)."""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise bad("input", f"{where}.content: only text parts are supported, not {kind!r}")
            if not isinstance(part.get("text"), str):
                raise bad("input", f"{where}.content: a text part needs a string text")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str) or not (content or allow_empty):
        raise bad("input", f"{where}.content must be a non-empty string or text parts")
    return content


def _reasoning_text(item: dict, where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise bad("input", f"{where}: a reasoning item's content must be text parts")
    return "\n".join(p["text"] for p in parts)


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            shown = str(kind)[:64]
            raise bad(
                "tools",
                f"tools[{i}]: hosted tool {shown!r} is not available on this server (only "
                f"function tools)",
                "unsupported_tool",
            )
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: t[k] for k in keys if k in t}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    shown = str(choice.get("type") if isinstance(choice, dict) else choice)[:64]
    raise bad("tool_choice", f"tool_choice {shown!r} is not supported (function tools only)")


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "text must be an object")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind in ("text", "json_object"):
        return fmt
    if kind != "json_schema":
        raise bad("text.format", 'text.format.type must be "text", "json_object" or "json_schema"')
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


def _template_kwargs(body: dict) -> dict | None:
    """chat_template_kwargs; `reasoning.effort` "none" switches thinking off (enable_thinking)."""
    kwargs = body.get("chat_template_kwargs")
    reasoning = body.get("reasoning")
    if reasoning is None:
        return kwargs
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    summary = reasoning.get("summary") if isinstance(reasoning, dict) else None
    if effort not in (None, *EFFORTS) or summary not in (None, "auto", "concise", "detailed"):
        raise bad(
            "reasoning",
            f"reasoning.effort must be one of {', '.join(EFFORTS)}; reasoning.summary auto, "
            f"concise or detailed",
        )
    if effort == "none" and isinstance(kwargs, dict | None):
        return {"enable_thinking": False} | (kwargs or {})
    return kwargs


# -- routes ---------------------------------------------------------------------------------------


async def create(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    body = await read_json(request)
    turn = parse(body, st, scope_of(credential(request)))

    def make(prompt_ids: list[list[int]], truncated: list[bool], start: str | None):
        return ResponsesBuilder(st, turn, start)

    try:
        return await generate.run_chat(request, turn.req, arrival, make)
    except APIError as e:
        raise renamed(e) from None


def _stored(request: web.Request):
    st = request.app[STATE]
    scope, rid = scope_of(credential(request)), request.match_info["response_id"]
    return st, scope, rid


async def retrieve(request: web.Request) -> web.Response:
    st, scope, rid = _stored(request)
    entry = st.store.get(scope, rid)
    if entry is None:
        raise APIError(404, "No response with this id is stored.", "response_id", "not_found")
    return json_response(entry.body)


async def delete(request: web.Request) -> web.Response:
    st, scope, rid = _stored(request)
    if not st.store.delete(scope, rid):
        raise APIError(404, "No response with this id is stored.", "response_id", "not_found")
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})
