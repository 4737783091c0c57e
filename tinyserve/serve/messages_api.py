"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a thin
translation: the body becomes a chat body that `protocol.parse_chat` validates (one parameter
mapping), runs down the one request path (serve/generate.py), and `MessagesBuilder` turns the
outputs into content blocks (thinking, text, tool_use) and Anthropic's stream events.

Errors take Anthropic's shape on these routes (middleware.anthropic_error). `thinking` switches
the template's `enable_thinking`, and its `budget_tokens` becomes the chat request's
`thinking_token_budget` (the engine forces `</think>` once it is spent). A final assistant message
of text is a prefill the model continues.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from tinyserve.outputs import CompletionOutput
from tinyserve.serve import generate, protocol
from tinyserve.serve.errors import APIError, bad, unsupported
from tinyserve.serve.middleware import anthropic_error, json_response, read_json
from tinyserve.serve.protocol import GenerateRequest
from tinyserve.serve.reasoning import OutputSplit
from tinyserve.serve.responses import dumps
from tinyserve.serve.responses_api import EXTRAS
from tinyserve.serve.state import STATE, ServerState

MAX_MESSAGES = 2048


def parse(body: Any, st: ServerState, count_only: bool = False) -> GenerateRequest:
    """A Messages body -> the chat request it is (`count_only`: count_tokens, no max_tokens)."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not count_only and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise bad("max_tokens", "max_tokens is required: an integer >= 1")
    for key in ("container", "mcp_servers"):
        if body.get(key) is not None:
            raise unsupported(key, key)
    chat = {k: body[k] for k in EXTRAS if k in body and k != "stop"}
    for key in ("model", "temperature", "top_p", "top_k", "stream"):
        if key in body:
            chat[key] = body[key]
    messages = _system(body.get("system")) + chat_messages(body.get("messages"))
    chat["messages"] = messages
    chat["max_tokens"] = None if count_only else max_tokens
    chat["stop"] = body.get("stop_sequences")
    chat["tools"] = _tools(body.get("tools"))
    chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(body.get("tool_choice"))
    chat["chat_template_kwargs"] = _thinking(body, max_tokens)
    thinking = body.get("thinking")  # a valid one: _thinking checked it
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        chat["thinking_token_budget"] = thinking["budget_tokens"]
    last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" not in last and last["content"]:
        chat["continue_final_message"] = True  # a prefill: the model continues it
    if count_only:
        chat.pop("stream", None)
    return protocol.parse_chat(chat, st.info)


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        for b in content
    ):
        raise bad(where, f"{where} must be a string or a list of text blocks")
    return "\n".join(b["text"] for b in content)


def chat_messages(value: Any) -> list[dict]:
    """Anthropic messages -> chat messages: tool_use blocks become an assistant's tool_calls,
    tool_result blocks tool messages (each must answer a tool_use before it), thinking blocks
    the assistant's reasoning_content."""
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise bad("messages", f"messages must be a list of 1 to {MAX_MESSAGES} messages")
    out, calls = [], set()
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad("messages", f'{where}.role must be "user" or "assistant"')
        content = m.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            raise bad("messages", f"{where}.content must be a string or a non-empty block list")
        if role == "user":
            out += _user(content, where, calls)
        else:
            out.append(_assistant(content, where, calls))
    return out


def _user(blocks: list, where: str, calls: set[str]) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            if b.get("tool_use_id") not in calls:
                raise bad("messages", f"{at}: tool_use_id matches no tool_use before it")
            result = b.get("content", "")
            text = _text_blocks(result, "messages") if result is not None else ""
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise bad("messages", f"{at}: unsupported block type {str(kind)[:64]!r} here")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list, where: str, calls: set[str]) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            msg["content"] += b["text"]
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            msg["reasoning_content"] = b["thinking"]
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            tid, name, args = b.get("id"), b.get("name"), b.get("input")
            if not (isinstance(tid, str) and isinstance(name, str) and isinstance(args, dict)):
                raise bad(
                    "messages", f"{at}: a tool_use needs a string id and name, an input object"
                )
            calls.add(tid)
            f = {"name": name, "arguments": json.dumps(args)}
            msg.setdefault("tool_calls", []).append({"id": tid, "type": "function", "function": f})
        else:
            raise bad("messages", f"{at}: unsupported block type {str(kind)[:64]!r} here")
    if not msg["content"] and ("tool_calls" in msg or "reasoning_content" in msg):
        msg["content"] = None
    return msg


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = str(t.get("type") if isinstance(t, dict) else t)[:64]
            raise bad("tools", f"tools[{i}]: server tool {kind!r} is not available on this server")
        f = {"name": t.get("name"), "parameters": t.get("input_schema")}
        if t.get("description") is not None:
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("tool_choice", "tool_choice.disable_parallel_tool_use must be a boolean")
    parallel = None if parallel is None else not parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad("tool_choice", 'tool_choice.type must be "auto", "any", "tool" or "none"')


def _thinking(body: dict, max_tokens: Any) -> Any:
    """`thinking` -> the template's enable_thinking (over chat_template_kwargs' own)."""
    kwargs, thinking = body.get("chat_template_kwargs"), body.get("thinking")
    if thinking is None:
        return kwargs
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad("thinking", "thinking.budget_tokens must be an integer >= 1")
        if isinstance(max_tokens, int) and budget >= max_tokens:
            raise bad("thinking", "thinking.budget_tokens must be less than max_tokens")
    elif kind not in ("disabled", "adaptive"):
        raise bad("thinking", 'thinking.type must be "enabled", "disabled" or "adaptive"')
    if not isinstance(kwargs, dict | None):
        return kwargs  # parse_chat refuses it
    return (kwargs or {}) | {"enable_thinking": kind != "disabled"}


# -- routes ---------------------------------------------------------------------------------------


async def create(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    req = parse(await read_json(request), st)

    def make(prompt_ids: list[list[int]], truncated: list[bool], start: str | None):
        return MessagesBuilder(st, req, len(prompt_ids[0]), start)

    return await generate.run_chat(request, req, arrival, make)


async def count_tokens(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = parse(await read_json(request), st, count_only=True)
    ids, _ = await generate.render(st, req)
    return json_response({"input_tokens": len(ids)})


# -- the response ---------------------------------------------------------------------------------


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use.input (an object; arguments sent as a JSON string that
    holds no object are kept under "arguments")."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


class MessagesBuilder:
    """One message's body and events. Streaming keeps one open content block at a time:
    thinking, then text, then tool_use blocks, each stopped before the next starts."""

    def __init__(self, st: ServerState, req: GenerateRequest, num_prompt: int, start) -> None:
        self.st, self.num_prompt = st, num_prompt
        self.id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        tools = req.tools.streams() if req.tools is not None else None
        self.split = OutputSplit(start, tools, st.tokenizer)
        self.extras = None
        self.blocks: list[str] = []  # the block types so far; the last one open while streaming
        self.is_open = False
        self.ended: tuple[str | None, Any] = (None, None)  # finish_reason, stop_reason

    def _message(self, content: list[dict], stop: tuple[str | None, str | None], usage: dict):
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.st.served[0],
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def _usage(self, use: dict, num_thinking: int) -> dict:
        cached = use["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": use["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": use["completion_tokens"],
            "output_tokens_details": {"thinking_tokens": num_thinking},
        }

    # -- whole ----------------------------------------------------------------------------------

    def response(self, choices: list[tuple[int, CompletionOutput]], use: dict) -> dict:
        [(_, o)] = choices
        reasoning, text, calls, finish = self.split.whole(o)
        content = []
        if reasoning is not None:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text:
            content.append({"type": "text", "text": text})
        for c in calls:
            args, name = _input(c["function"]["arguments"]), c["function"]["name"]
            content.append(
                {"type": "tool_use", "id": _tool_id(c["id"]), "name": name, "input": args}
            )
        if finish == "abort":
            raise _shutting_down()
        usage = self._usage(use, self.split.num_reasoning_tokens(0, o))
        return self._message(content, _stop(finish, o.stop_reason), usage)

    # -- streaming ------------------------------------------------------------------------------

    def start(self, num_choices: int) -> bytes:
        usage = {"input_tokens": self.num_prompt, "output_tokens": 0}
        message = self._message([], (None, None), usage)
        return _event("message_start", message=message) + _event("ping")

    def delta_chunk(self, index: int, o: CompletionOutput) -> bytes:
        reasoning, text, calls, finish = self.split.feed(index, o)
        out = []
        if reasoning:
            out.append(self._delta("thinking", {"type": "thinking_delta", "thinking": reasoning}))
        if text:
            out.append(self._delta("text", {"type": "text_delta", "text": text}))
        for d in calls:
            if "id" in d:  # a call's first delta
                block = {"type": "tool_use", "id": _tool_id(d["id"]), "name": d["function"]["name"]}
                out.append(self._open(block | {"input": {}}))
            if d["function"]["arguments"]:
                delta = {"type": "input_json_delta", "partial_json": d["function"]["arguments"]}
                out.append(self._delta("tool_use", delta))
        if finish is not None:
            self.ended = (finish, o.stop_reason)
            out.append(self._close())
        return b"".join(out)

    def _delta(self, kind: str, delta: dict) -> bytes:
        out = b""
        if not self.is_open or self.blocks[-1] != kind:
            empty = {"thinking": {"thinking": "", "signature": ""}, "text": {"text": ""}}[kind]
            out = self._open({"type": kind} | empty)
        index = len(self.blocks) - 1
        return out + _event("content_block_delta", index=index, delta=delta)

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.blocks.append(block["type"])
        self.is_open = True
        return out + _event("content_block_start", index=len(self.blocks) - 1, content_block=block)

    def _close(self) -> bytes:
        if not self.is_open:
            return b""
        self.is_open = False
        return _event("content_block_stop", index=len(self.blocks) - 1)

    def finish(self, use: dict) -> bytes:
        finish, stop_reason = self.ended
        if finish == "abort":
            return self._close() + self.error_event(_shutting_down())
        stop = _stop(finish, stop_reason)
        usage = self._usage(use, self.split.num_reasoning_tokens(0))
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        return (
            self._close()
            + _event("message_delta", delta=delta, usage=usage)
            + _event("message_stop")
        )

    def error_event(self, error: APIError) -> bytes:
        return b"event: error\ndata: " + dumps(anthropic_error(error)) + b"\n\n"

    def close(self) -> bytes:
        return b""


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"


def _shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type="server_error", code="shutting_down")
