"""Request fields -> StructuredOutputsParams, and the grammar compiled before a request is queued.

A body may set one of: OpenAI's `response_format` (`{"type": "text" | "json_object" |
"json_schema", "json_schema": {"name", "schema", "strict", "description"}}`; a grammar always
holds, so `strict` changes nothing), vLLM's `structured_outputs` (`json` | `regex` | `choice` |
`grammar` | `json_object`, with `disable_any_whitespace`) or its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`. A forced tool choice (serve/tools.py) brings
its own grammar. `prepare` compiles it in the executor (xgrammar, cached by spec) before the request
is queued, so an invalid schema, regex or grammar is a 400 naming the field the client used.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from tinyserve.sampling_params import InvalidParameter, StructuredOutputsParams
from tinyserve.serve.tools import parse_tools, tool_form, tool_grammar

if TYPE_CHECKING:
    from tinyserve.engine.async_engine import AsyncEngine
    from tinyserve.model.tokenizer import Tokenizer
    from tinyserve.serve.protocol import GenerateRequest

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def apply(req: GenerateRequest, body: dict, chat: bool) -> None:
    """Set `req.params.structured_outputs` (and `req.structured_param`, the field it came from)
    and, for chat, `req.tools` from the body. Raises InvalidParameter."""
    found = _specs(body)
    if len(found) > 1:
        fields = ", ".join(param for param, _ in found)
        raise InvalidParameter(found[1][0], f"set only one of {fields}")
    tools = parse_tools(body) if chat else None
    if found:
        param, spec = found[0]
        if tools is not None and tools.is_forced:
            raise InvalidParameter(
                "tool_choice", f"a required or named tool_choice cannot be combined with {param}"
            )
        req.params.structured_outputs, req.structured_param = spec, param
    req.tools = tools


def _specs(body: dict) -> list[tuple[str, StructuredOutputsParams]]:
    found = []
    if (fmt := body.get("response_format")) is not None:
        if (spec := _response_format(fmt)) is not None:
            found.append(("response_format", spec))
    if (so := body.get("structured_outputs")) is not None:
        found.append(("structured_outputs", _structured_outputs(so)))
    if body.get("guided_whitespace_pattern") is not None:
        raise InvalidParameter(
            "guided_whitespace_pattern", "guided_whitespace_pattern is not supported"
        )
    guided = [key for key in GUIDED if body.get(key) is not None]
    if len(guided) > 1:
        raise InvalidParameter(guided[1], f"set only one of {', '.join(guided)}")
    if guided:
        key = guided[0]
        found.append((key, _spec(key, **{GUIDED[key]: body[key]})))
    return found


def _response_format(fmt: object) -> StructuredOutputsParams | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidParameter(
            "response_format",
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
        )
    js = fmt.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise InvalidParameter(
            "response_format", "response_format.json_schema must be an object with a name"
        )
    where = "response_format.json_schema"
    if not isinstance(js.get("schema"), dict):
        raise InvalidParameter("response_format", f"{where}.schema must be a JSON schema object")
    for key, kind, what in [("strict", bool, "a boolean"), ("description", str, "a string")]:
        if js.get(key) is not None and not isinstance(js[key], kind):
            raise InvalidParameter("response_format", f"{where}.{key} must be {what}")
    return _spec("response_format", json=js["schema"])


def _structured_outputs(so: object) -> StructuredOutputsParams:
    if not isinstance(so, dict):
        raise InvalidParameter("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(set(so) - set(_FIELDS))
    if unknown:
        raise InvalidParameter(
            "structured_outputs",
            f"structured_outputs: unsupported fields {', '.join(map(str, unknown))[:200]} "
            f"(supported: {', '.join(_FIELDS)})",
        )
    return _spec("structured_outputs", **so)


def _spec(param: str, **fields) -> StructuredOutputsParams:
    """The spec, with InvalidParameter naming the client's field (its message, vLLM's name)."""
    try:
        return StructuredOutputsParams(**fields)
    except InvalidParameter as e:
        if param == "structured_outputs":
            raise
        raise InvalidParameter(param, f"{param}: {e}") from None


async def prepare(engine: AsyncEngine, req: GenerateRequest, tokenizer: Tokenizer | None) -> None:
    """Before the request is queued: a forced tool choice's grammar (built in the executor:
    xgrammar's import and schema conversion are slow), then the request's grammar compiled in the
    executor (cached by spec, so the engine's own compile of it is a hit). Raises
    InvalidParameter naming the request's field."""
    tools = req.tools
    if tools is not None:
        tools.form = tool_form(tokenizer.chat_template if tokenizer is not None else None)
    if tools is not None and tools.is_forced:
        loop = asyncio.get_running_loop()
        ebnf = await loop.run_in_executor(None, tool_grammar, tools)
        req.params.structured_outputs = StructuredOutputsParams(grammar=ebnf)
        req.structured_param = "tools"
    spec = req.params.structured_outputs
    if spec is None:
        return
    try:
        await engine.compile_grammar(spec)
    except InvalidParameter as e:
        if req.structured_param == "structured_outputs":
            raise
        detail = str(e).split(": ", 1)[-1]  # "invalid structured_outputs.<kind>: <what>"
        raise InvalidParameter(
            req.structured_param, f"invalid {req.structured_param}: {detail}"
        ) from None
