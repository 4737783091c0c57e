"""Tool calls out of generated text: one `ToolParser` per choice turns text, chunk by chunk, into
content and OpenAI `tool_calls` deltas (the first of a call: index, id, type, function.name; then
function.arguments fragments); `extract_tool_calls` reads a whole output with the same parser, so
streamed and whole responses agree. Forms (serve/tools.py picks one): Hermes / Qwen
`<tool_call>{json}</tool_call>`; Llama 3's bare `{"name": ..., "parameters": ...}`, `; ` between.
"""

from __future__ import annotations

import json
import re
import uuid

HERMES, LLAMA3 = "hermes", "llama3_json"
_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_ARG_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


class _NotACall(ValueError):
    pass


class _Call:
    """One tool call's JSON object as its text grows: the header delta (id, type, name) once the
    name is complete, then the raw text of its arguments value as it arrives."""

    __slots__ = ("index", "start", "name", "num_sent")

    def __init__(self, index: int, start: int) -> None:
        self.index, self.start = index, start  # start: the object's offset in the parser's text
        self.name: str | None = None  # set once the header went out
        self.num_sent = 0  # characters of the arguments sent

    @property
    def is_started(self) -> bool:
        return self.name is not None

    def advance(self, body: str, done: bool) -> list[dict]:
        """Deltas for `body`, the object's text so far (`done`: all of it). Raises ValueError
        (_NotACall) when it cannot be a call; nothing was sent for it then unless `is_started`."""
        i = _skip_ws(body, 0)
        if i == len(body) or body[i] != "{":
            if i < len(body) or done:
                raise _NotACall
            return []
        try:
            members, _ = _scan_object(body, i)
        except ValueError:
            raise _NotACall from None
        spans = {key: (s, e) for key, s, e in members}
        if self.name is None and not spans.keys() <= {"name", *_ARG_KEYS}:
            raise _NotACall  # some other JSON object (Llama 3's form has no tag)
        out = []
        if self.name is None and (span := spans.get("name")) and span[1] is not None:
            name = json.loads(body[span[0] : span[1]])
            if not isinstance(name, str) or not name:
                raise _NotACall
            self.name = name
            head = {"name": name, "arguments": ""}
            call = {"index": self.index, "id": _call_id(), "type": "function"}
            out.append(call | {"function": head})
        if done:  # the whole object: valid JSON with a name and object (or string) arguments
            obj = json.loads(body)  # after the name: a call cut short fails as a call
            args = next((obj[k] for k in _ARG_KEYS if k in obj), {})
            if self.name is None or not isinstance(args, dict | str):
                raise _NotACall
        if self.name is None:
            return out
        key = next((k for k in _ARG_KEYS if k in spans), None)
        if key is None:
            args = "{}" if done else ""
        else:
            s, e = spans[key]
            if e is not None and body[s] == '"':  # arguments sent as a JSON string
                args = json.loads(body[s:e])
            elif e is not None or body[s : s + 1] in ("{", "["):
                args = body[s:e]  # an object's text so far belongs to it alone
            else:
                args = ""  # a scalar, or a value not begun
        if len(args) > self.num_sent:
            out.append({"index": self.index, "function": {"arguments": args[self.num_sent :]}})
            self.num_sent = len(args)
        return out


class ToolParser:
    """One choice's text in, (content, tool-call deltas) out, chunk by chunk; deltas are shaped as
    OpenAI streams them: the first of a call has index, id, type and function.name, the rest add
    function.arguments fragments. Whitespace next to a call is not content; text that turns out
    not to be a call (bad JSON, no name) is content, unless part of it was sent as a call: then
    `failed` is set."""

    def __init__(self, form: str) -> None:
        self.form = form
        self.text = ""
        self.pos = 0  # text before it is handled
        self.call: _Call | None = None  # the call being read
        self.num_calls = 0  # calls whose header went out
        self.failed = False
        self.mode: str | None = None  # Llama 3: "json" (calls) or "text", from the first character
        self._held = ""  # trailing whitespace of the content, sent once more content follows
        self._after_call = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        content, calls = [], []
        if self.form == HERMES:
            self._hermes(final, content, calls)
        else:
            self._llama3(final, content, calls)
        if final and not self.num_calls:
            content.append(self._held)
            self._held = ""
        return "".join(content), calls

    def _content(self, text: str, out: list[str]) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            self._after_call = not text
        text = self._held + text
        keep = text.rstrip(_WS)
        self._held = text[len(keep) :]
        if keep:
            out.append(keep)

    def _open(self, start: int) -> None:
        self.call = _Call(self.num_calls, start)
        self._held = ""

    def _advance(self, end: int | None, final: bool, raw: str, out: list[str], calls) -> bool:
        """Feed the current call its text up to `end` (None: all so far, maybe not complete).
        Returns whether the call is over; text that is not a call goes to content as `raw`."""
        call = self.call
        done = end is not None or final
        try:
            calls.extend(call.advance(self.text[call.start : end], done))
        except ValueError:  # _NotACall, or JSON that json.loads refused
            if call.is_started:
                self.failed = True
            else:
                self._content(raw, out)
            self.call = None
            return True
        if done:
            self.num_calls += call.is_started
            self.call, self._after_call = None, True
        return done

    def _hermes(self, final: bool, out: list[str], calls: list[dict]) -> None:
        text = self.text
        while True:
            if self.call is None:
                i = text.find(_OPEN, self.pos)
                if i < 0:
                    end = len(text) if final else len(text) - _partial_tail(text, self.pos, _OPEN)
                    self._content(text[self.pos : end], out)
                    self.pos = end
                    return
                self._content(text[self.pos : i], out)
                self._open(i + len(_OPEN))
                self.pos = i
            j = text.find(_CLOSE, self.call.start)
            end = None if j < 0 else j
            stop = len(text) if j < 0 else j + len(_CLOSE)
            if not self._advance(end, final, text[self.pos : stop], out, calls):
                return
            self.pos = stop
            if j < 0:
                return

    def _llama3(self, final: bool, out: list[str], calls: list[dict]) -> None:
        text = self.text
        if self.mode is None:
            i = _skip_ws(text, 0)
            if text.startswith(_PYTHON_TAG, i):  # kept when skip_special_tokens is off
                i = _skip_ws(text, i + len(_PYTHON_TAG))
            if not final and _PYTHON_TAG.startswith(text[i:]):  # nothing yet, or the tag forming
                return
            self.mode = "json" if text.startswith("{", i) else "text"
            self.pos = i if self.mode == "json" else 0
        while self.mode == "json":
            if self.call is None:
                i = self.pos
                while i < len(text) and (text[i] in _WS or (text[i] == ";" and self.num_calls)):
                    i += 1
                if i == len(text):
                    return
                if text[i] != "{":
                    self.mode, self.pos = "text", i
                    break
                self._open(i)
                self.pos = i
            end = _value_end(text, self.call.start)  # counts brackets: "{" always starts one
            raw = text[self.pos : len(text) if end is None else end]
            if not self._advance(end, final, raw, out, calls):
                return
            self.pos = len(text) if end is None else end
            if not self.num_calls:  # the first object was no call: it is all text
                self.mode = "text"
        if self.mode == "text":
            self._content(text[self.pos :], out)
            self.pos = len(text)


def extract_tool_calls(form: str, text: str) -> tuple[str | None, list[dict]]:
    """A whole output's (content, tool_calls); the content is None when only calls were made.
    The same parser as streaming, so both give the same calls; if a call went wrong half way,
    everything is content (as vLLM's parsers fall back)."""
    parser = ToolParser(form)
    content, deltas = parser.feed(text, final=True)
    calls = merge_deltas(deltas)
    if parser.failed or not calls:
        return text, []
    return content or None, calls


def merge_deltas(deltas: list[dict]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class ToolStreams:
    """A response's tool-call parsing, one parser per choice; finish_reason "stop" becomes
    "tool_calls" for a choice that called a tool."""

    def __init__(self, form: str) -> None:
        self.form = form
        self.parsers: dict[int, ToolParser] = {}

    def feed(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[str, list[dict], str | None]:
        parser = self.parsers.setdefault(index, ToolParser(self.form))
        content, calls = parser.feed(text, final=finish_reason is not None)
        if finish_reason == "stop" and parser.num_calls:
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        content, calls = extract_tool_calls(self.form, text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- partial JSON ---------------------------------------------------------------------------------


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _partial_tail(text: str, start: int, tag: str) -> int:
    """Length of the longest tail of text[start:] that `tag` starts with (it may be forming)."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _string_end(s: str, i: int) -> int | None:
    """End of the JSON string opening at s[i] (a quote); None if it is not closed yet."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """End of the JSON value starting at s[i]; None while it may still grow. Raises ValueError
    for what cannot start a value (brackets are only counted: json.loads checks the rest)."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                if (j := _string_end(s, j)) is None:
                    return None
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(s, i)
    if m is None:
        raise ValueError(f"no JSON value at {i}")
    return None if m.end() == len(s) else m.end()


def _scan_object(s: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The members of the object opening at s[i] so far: (key, value start, value end or None),
    and the object's end (None while open). Raises ValueError when it is not an object."""
    members, j = [], i + 1
    while True:
        j = _skip_ws(s, j)
        if j == len(s):
            return members, None
        if s[j] == "}":
            return members, j + 1
        if s[j] == "," and members:
            j = _skip_ws(s, j + 1)
            if j == len(s):
                return members, None
        if s[j] != '"':
            raise ValueError("expected a key")
        if (key_end := _string_end(s, j)) is None:
            return members, None
        key = json.loads(s[j:key_end])
        j = _skip_ws(s, key_end)
        if j == len(s):
            return members, None
        if s[j] != ":":
            raise ValueError("expected ':'")
        j = _skip_ws(s, j + 1)
        if j == len(s):
            members.append((key, j, None))
            return members, None
        end = _value_end(s, j)
        members.append((key, j, end))
        if end is None:
            return members, None
        j = end
