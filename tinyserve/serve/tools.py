"""Tool calling: `tools` / `tool_choice` / `parallel_tool_calls` validated, tool history in the
messages, and the grammar that forces a call (the parser of calls: serve/tool_parser.py).

Two output forms, chosen from the chat template (as a vLLM user picks `--tool-call-parser`):
Hermes / Qwen `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the default) and
Llama 3's JSON `{"name": ..., "parameters": {...}}` (`; ` between calls). `required` and a named
choice force that same form through xgrammar's structural tags, so one parser reads forced and
free output. Everything a client controls raises InvalidParameter naming its field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from tinyserve.sampling_params import InvalidParameter
from tinyserve.serve.tool_parser import HERMES, LLAMA3, ToolStreams

MAX_TOOLS = 128  # OpenAI's cap
# Runs of whitespace inside forced arguments: compact JSON needs 1, pretty-printed a few; a
# model left unbounded (tiny ones at temperature 1) may spend its whole budget on blanks.
MAX_WHITESPACE = 8
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's, plus the "." and ":" of MCP-style names
# Each form: (call opening before the name, between name and arguments, closing, separator).
_FORMS = {
    HERMES: ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n"),
    LLAMA3: ('{"name": "', '", "parameters": ', "}", "; "),
}
# xgrammar's errors open with a timestamp and the C++ file and line: not for clients.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


# -- the request ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolRequest:
    tools: list[dict]  # as sent (validated): what the chat template's `tools` variable gets
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None  # the function a named choice forces
    parallel: bool  # parallel_tool_calls: more than one call in a response
    form: str = HERMES  # the model's output form, from its chat template (`tool_form`)

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "named")

    def streams(self) -> ToolStreams | None:
        """The response's parsers; None when tool calls are not parsed (tool_choice none)."""
        return None if self.choice == "none" else ToolStreams(self.form)


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None without tools."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise InvalidParameter(legacy, f"{legacy} is not supported: use tools and tool_choice")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
        raise InvalidParameter("tools", f"tools must be a list of at most {MAX_TOOLS} tools")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tools must have distinct function names")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    choice, name = _tool_choice(body.get("tool_choice"), names)
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel is not False)


def _tool(tool: object, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidParameter("tools", f'{where} must be an object with type "function"')
    f = tool.get("function")
    if not isinstance(f, dict):
        raise InvalidParameter("tools", f"{where}.function must be an object")
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidParameter(
            "tools", f"{where}.function.name must be 1-64 characters of a-z, A-Z, 0-9, _ . : -"
        )
    for key, kind, what in [
        ("description", str, "a string"),
        ("parameters", dict, "a JSON schema (an object)"),
        ("strict", bool, "a boolean"),
    ]:
        if f.get(key) is not None and not isinstance(f[key], kind):
            raise InvalidParameter("tools", f"{where}.function.{key} must be {what}")
    return tool


def _tool_choice(choice: object, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise InvalidParameter("tool_choice", f'tool_choice "{choice}" needs tools')
        return choice, None
    f = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(f, dict)):
        raise InvalidParameter(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    if f.get("name") not in names:
        shown = str(f.get("name"))[:64]
        raise InvalidParameter("tool_choice", f"tool_choice names {shown!r}, which is not a tool")
    return "named", f["name"]


def message_fields(m: dict, i: int) -> dict:
    """The tool fields of input message i as chat templates read them (transformers' convention,
    which vLLM follows): an assistant's `tool_calls` with `arguments` decoded to objects, a tool
    message's `tool_call_id`."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise InvalidParameter(
                "messages", f"messages[{i}].tool_calls must be a list, on assistant messages"
            )
        where = f"messages[{i}].tool_calls"
        out["tool_calls"] = [_input_call(c, f"{where}[{j}]") for j, c in enumerate(calls)]
    tool_call_id = m.get("tool_call_id")
    if tool_call_id is not None:
        if not isinstance(tool_call_id, str):
            raise InvalidParameter("messages", f"messages[{i}].tool_call_id must be a string")
        out["tool_call_id"] = tool_call_id
    return out


def _input_call(call: object, where: str) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise InvalidParameter("messages", f"{where} must have a function with a name")
    args = f.get("arguments")
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except ValueError:
            raise InvalidParameter("messages", f"{where}.function.arguments is not JSON") from None
    elif not args:
        args = {}
    out = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# -- the forcing grammar --------------------------------------------------------------------------


def tool_form(chat_template: str | None) -> str:
    """The tool-call form a chat template teaches its model: Hermes / Qwen when it writes
    `<tool_call>` (and for templates that render no tools), Llama 3's JSON when it speaks of
    `"parameters"` or `<|python_tag|>`."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3
    return HERMES


def tool_grammar(req: ToolRequest) -> str:
    """EBNF (start rule `root`) for a forced choice: exactly the named call, or one or more calls
    (exactly one without parallel_tool_calls) of any tool, each call's arguments matching its
    `parameters` schema (`{"type": "object"}` when absent). Imports xgrammar: call it off the
    event loop. Raises InvalidParameter("tools") for a schema xgrammar rejects."""
    # Key order kept: xgrammar emits an object's properties in the order its schema lists them.
    tools = json.dumps([t["function"] for t in req.tools])
    return _tool_grammar(tools, req.form, req.name, req.parallel)


@lru_cache(maxsize=64)
def _tool_grammar(tools_json: str, form: str, name: str | None, parallel: bool) -> str:
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    begin, middle, end, separator = _FORMS[form]
    tags = [
        TagFormat(
            begin=begin + f["name"] + middle,
            content=JSONSchemaFormat(
                json_schema=f.get("parameters") or {"type": "object"},
                max_whitespace_cnt=MAX_WHITESPACE,
            ),
            end=end,
        )
        for f in json.loads(tools_json)
        if name in (None, f["name"])
    ]
    if name is not None:
        fmt = tags[0]
    else:
        fmt = TagsWithSeparatorFormat(
            tags=tags, separator=separator, at_least_one=True, stop_after_first=not parallel
        )
    try:
        return str(xgr.Grammar.from_structural_tag(StructuralTag(format=fmt)))
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
        lines = str(e).strip().splitlines()
        message = _ERROR_PREFIX.sub("", lines[0] if lines else "")
        raise InvalidParameter(
            "tools", f"invalid tools: a function's parameters schema: {message[:300]}"
        ) from None
