"""The Responses API's output: a response object with its output items (reasoning, message,
function_call) and, when streamed, the typed events in their documented order, each with its
sequence_number: response.created, response.in_progress, per item output_item.added,
content_part.added, the text / reasoning_text / function_call_arguments deltas and their done,
content_part.done, output_item.done; then response.completed (or .incomplete at
max_output_tokens). A finished response with `store` goes to the server's ResponseStore.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from tinyserve.outputs import CompletionOutput
from tinyserve.serve.reasoning import OutputSplit
from tinyserve.serve.responses import dumps

if TYPE_CHECKING:
    from tinyserve.serve.errors import APIError
    from tinyserve.serve.responses_api import Turn
    from tinyserve.serve.state import ServerState


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBuilder:
    """One response's object and events. Streaming keeps one open output item at a time:
    reasoning, then message text, then function calls, each closed before the next opens."""

    def __init__(self, st: ServerState, turn: Turn, start: str | None) -> None:
        self.st, self.turn = st, turn
        self.id, self.created = _item_id("resp"), int(time.time())
        tools = turn.req.tools.streams() if turn.req.tools is not None else None
        self.split = OutputSplit(start, tools, st.tokenizer)
        self.extras = None
        self.seq = 0  # the next event's sequence_number
        self.items: list[dict] = []  # output items, the last one open while streaming
        self.is_open = False
        self.finish_reason: str | None = None

    def _object(self, status: str, output: list[dict], use: dict | None = None) -> dict:
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.st.served[0],
            "output": output,
            "store": self.turn.store,
            **self.turn.echo,
            "usage": None if use is None else _usage(use, self._num_reasoning()),
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        elif status == "failed":
            body["error"] = {"code": "server_error", "message": "The request was aborted."}
        return body

    def _num_reasoning(self, o: CompletionOutput | None = None) -> int:
        return self.split.num_reasoning_tokens(0, o)

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(body) + b"\n\n"

    # -- whole ----------------------------------------------------------------------------------

    def response(self, choices: list[tuple[int, CompletionOutput]], use: dict) -> dict:
        [(_, o)] = choices
        reasoning, content, calls, finish = self.split.whole(o)
        status = _status(finish)
        done = "incomplete" if status == "incomplete" else "completed"
        output = []
        if reasoning is not None:
            output.append(_reasoning_item(_item_id("rs"), reasoning, done))
        if content:
            output.append(_message_item(_item_id("msg"), content, done))
        for c in calls:
            f = c["function"]
            output.append(_call_item(_item_id("fc"), c["id"], f["name"], f["arguments"], done))
        body = self._object(status, output)
        body["usage"] = _usage(use, self._num_reasoning(o))
        self._store(body)
        return body

    # -- streaming ------------------------------------------------------------------------------

    def start(self, num_choices: int) -> bytes:
        body = self._object("in_progress", [])
        return self._event("response.created", response=body) + self._event(
            "response.in_progress", response=body
        )

    def delta_chunk(self, index: int, o: CompletionOutput) -> bytes:
        reasoning, text, calls, finish = self.split.feed(index, o)
        out = []
        if reasoning:
            out.append(self._delta("reasoning", reasoning))
        if text:
            out.append(self._delta("message", text))
        for d in calls:
            if "id" in d:  # a call's first delta
                out.append(self._open(_call_item(_item_id("fc"), d["id"], d["function"]["name"])))
            if d["function"]["arguments"]:
                out.append(self._delta("function_call", d["function"]["arguments"]))
        if finish is not None:
            self.finish_reason = finish
            out.append(self._close())
        return b"".join(out)

    def _delta(self, kind: str, text: str) -> bytes:
        out = b""
        if not self.is_open or self.items[-1]["type"] != kind:
            item_id = _item_id({"reasoning": "rs", "message": "msg"}[kind])
            make = _reasoning_item if kind == "reasoning" else _message_item
            out = self._open(make(item_id, "", "in_progress"))
        item, where = self.items[-1], self._where()
        if kind == "function_call":
            item["arguments"] += text
            return out + self._event("response.function_call_arguments.delta", **where, delta=text)
        item["content"][0]["text"] += text
        if kind == "reasoning":
            return out + self._event(
                "response.reasoning_text.delta", **where, content_index=0, delta=text
            )
        return out + self._event(
            "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
        )

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _open(self, item: dict) -> bytes:
        out = self._close()
        self.items.append(item)
        self.is_open = True
        empty = dict(item, content=[]) if "content" in item else dict(item)
        out += self._event(
            "response.output_item.added", output_index=len(self.items) - 1, item=empty
        )
        if "content" in item:
            part = dict(item["content"][0])
            out += self._event(
                "response.content_part.added", **self._where(), content_index=0, part=part
            )
        return out

    def _close(self) -> bytes:
        if not self.is_open:
            return b""
        self.is_open = False
        item, where = self.items[-1], self._where()
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        out = b""
        if item["type"] == "function_call":
            out += self._event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            )
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {"logprobs": []} if kind == "output_text" else {}
            out += self._event(
                f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra
            )
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        return out + self._event(
            "response.output_item.done", output_index=where["output_index"], item=item
        )

    def finish(self, use: dict) -> bytes:
        out = self._close()
        status = _status(self.finish_reason)
        body = self._object(status, self.items, use)
        self._store(body)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        return out + self._event(kind.get(status, "response.failed"), response=body)

    def error_event(self, error: APIError) -> bytes:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    def close(self) -> bytes:
        return b""

    def _store(self, body: dict) -> None:
        if not self.turn.store or body["status"] not in ("completed", "incomplete"):
            return
        messages = list(self.turn.history)
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        for item in body["output"]:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                msg["content"] = (msg["content"] or "") + item["content"][0]["text"]
            else:
                call = {"name": item["name"], "arguments": item["arguments"]}
                msg.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function", "function": call}
                )
        if msg["content"] or len(msg) > 2:
            messages.append(msg)
        self.st.store.put(self.turn.scope, self.id, body, messages)


def _status(finish_reason: str | None) -> str:
    if finish_reason == "length":
        return "incomplete"
    return "failed" if finish_reason == "abort" else "completed"


def _usage(use: dict, num_reasoning: int) -> dict:
    return {
        "input_tokens": use["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": use["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": use["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": use["total_tokens"],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str = "", status: str = "in_progress"
) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
