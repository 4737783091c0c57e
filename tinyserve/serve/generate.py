"""The one request path of every generation API: a validated `GenerateRequest` and its prompts in,
one engine request per prompt (a `Flight`), the API's body or SSE stream out through its builder.

Chat, completions, /v1/responses and /v1/messages differ only in their builders (chat and
completions: responses.ResponseBuilder; then responses_api's and messages_api's), which turn engine
outputs into that API's shapes: `start(num_choices)`, `delta_chunk(i, output)`, `finish(usage)`,
`error_event(error)`, `close()` (streams; bytes, b"" for nothing) and `response(choices, usage)` (a
whole body), with `id` and `extras` (vLLM's, chat/completions).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from tinyserve.engine.async_engine import EngineDeadError
from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.sampling_params import InvalidParameter
from tinyserve.serve import echo, protocol, reasoning, structured
from tinyserve.serve.chat_template import render_chat
from tinyserve.serve.errors import APIError, bad
from tinyserve.serve.flight import Flight
from tinyserve.serve.middleware import json_response
from tinyserve.serve.protocol import GenerateRequest
from tinyserve.serve.responses import ResponseBuilder
from tinyserve.serve.state import STATE, ServerState

log = logging.getLogger("tinyserve.serve.server")

OFFLOAD_CHARS = 8_192  # tokenize longer inputs in the executor (~3 ms of work on the loop)
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class Builder(Protocol):
    id: str
    extras: Any

    def start(self, num_choices: int) -> bytes: ...
    def delta_chunk(self, index: int, o: CompletionOutput) -> bytes: ...
    def finish(self, use: dict) -> bytes: ...
    def error_event(self, error: APIError) -> bytes: ...
    def close(self) -> bytes: ...
    def response(self, choices: list[tuple[int, CompletionOutput]], use: dict) -> dict: ...


# A builder for the prompts as run: (prompt ids, which lost tokens to truncation) -> Builder.
MakeBuilder = Callable[[list[list[int]], list[bool]], Builder]


async def offload(fn: Callable, num_chars: int, *args) -> Any:
    if num_chars < OFFLOAD_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def prepare_grammar(st: ServerState, req: GenerateRequest) -> None:
    """Compile the request's structured-output grammar off the loop before anything is queued:
    an invalid schema, regex or grammar is a 400 here."""
    try:
        await structured.prepare(st.engine, req, st.tokenizer)
    except InvalidParameter as e:
        raise bad(e.param, str(e)) from None


async def render(st: ServerState, req: GenerateRequest) -> tuple[list[int], str]:
    """A chat request's prompt (ids, text), rendered by the chat template."""
    tokenizer = st.require_tokenizer("messages")
    tools = req.tools.tools if req.tools is not None else None
    num_chars = sum(len(m["content"]) for m in req.messages)
    try:
        return await offload(
            render_chat, num_chars, tokenizer, req.messages, tools, req.render_options
        )
    except InvalidParameter as e:
        raise bad(e.param, str(e)) from None


async def run_chat(
    request: web.Request,
    req: GenerateRequest,
    arrival: float,
    make_builder: Callable[[list[list[int]], list[bool], str | None], Builder] | None = None,
) -> web.StreamResponse:
    """A chat-shaped request (chat, responses, messages): render, then generate. `make_builder`
    also gets where the output starts (reasoning.output_start); default: chat's."""
    st = request.app[STATE]
    st.check_admission(1)  # cheap refusals before tokenizing
    await prepare_grammar(st, req)
    ids, text = await render(st, req)
    start = reasoning.output_start(st.config.reasoning_parser, text)
    # The engine's reasoning spec: the budget, and a grammar that applies after `</think>`.
    start, spec = reasoning.reasoning_params(
        st.tokenizer,
        start,
        req.reasoning_budget,
        req.params.structured_outputs,
        forced_tool=req.structured_param == "tools",
    )
    if spec is not None:
        req.params = dataclasses.replace(req.params, reasoning=spec)

    def make(prompt_ids: list[list[int]], truncated: list[bool]) -> Builder:
        if make_builder is None:
            return chat_builder(st, req, True, prompt_ids, truncated, start)
        return make_builder(prompt_ids, truncated, start)

    return await generate(request, req, [ids], arrival, make)


def chat_builder(
    st: ServerState,
    req: GenerateRequest,
    chat: bool,
    prompt_ids: list[list[int]],
    truncated: list[bool],
    start: str | None = None,
) -> ResponseBuilder:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    builder = ResponseBuilder(
        chat, rid, int(time.time()), st.served[0], st.tokenizer, req.top_logprobs, req.include_usage
    )
    tools = req.tools.streams() if chat and req.tools is not None else None
    if tools is not None or start is not None:
        builder.split = reasoning.OutputSplit(start, tools, st.tokenizer)
    builder.extras = echo.extras_for(builder, req, prompt_ids, truncated)
    return builder


async def generate(
    request: web.Request,
    req: GenerateRequest,
    prompt_ids: list[list[int]],
    arrival: float,
    make_builder: MakeBuilder,
) -> web.StreamResponse:
    st = request.app[STATE]
    kept = [protocol.truncate_prompt(ids, req) for ids in prompt_ids]
    truncated = [len(a) < len(b) for a, b in zip(kept, prompt_ids)]
    prompt_ids = kept
    params = [
        protocol.check_context(len(ids), req, st.info, st.config.clamp_max_tokens)
        for ids in prompt_ids
    ]
    st.check_admission(len(prompt_ids))
    builder = make_builder(prompt_ids, truncated)
    timeout = st.config.request_timeout
    deadline = None if timeout is None else arrival + timeout
    flight = Flight(st, builder.id, prompt_ids, params, deadline, req.cache_salt)
    outcome = None  # an APIError raised from here is counted by the errors middleware
    try:
        if req.stream:
            resp, outcome = await _stream(request, flight, builder, req.params.n)
        else:
            resp, outcome = await _collect(flight, builder, req.params.n)
        return resp
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        outcome = "aborted"
        raise
    finally:
        await flight.close(outcome)


async def _stream(request, flight: Flight, builder: Builder, n: int):
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    counts = [0] * (flight.num_prompts * n)
    outcome, error = "ok", None
    try:
        await resp.write(builder.start(len(counts)))
        while (item := await flight.next()) is not None:
            k, delta = item
            outputs = [(k * n + o.index, o) for o in delta.outputs]
            if builder.extras is not None:  # an echo may wait for its prompt's logprobs
                outputs = builder.extras.feed(k, delta)
            await _write_outputs(resp, flight, builder, outputs, counts)
        if builder.extras is not None:
            await _write_outputs(resp, flight, builder, builder.extras.flush(), counts)
        if flight.timed_out and flight.aborted:  # else it finished just before the deadline
            outcome, error = "timeout", _timeout_error()
        else:
            await resp.write(builder.finish(flight.usage(sum(counts))))
    except ConnectionResetError:  # the client went away while we wrote
        return resp, "aborted"
    except (EngineDeadError, InvalidParameter, APIError) as e:
        outcome, error = _as_api_error(e)
    except Exception:  # a bug in this request's post-processing: only this request fails
        log.exception("error while streaming %s", builder.id)
        outcome, error = "error", APIError(500, "Internal server error.", type="server_error")
    if error is not None:  # after the headers went out, an error is an SSE event
        with contextlib.suppress(ConnectionResetError):
            await resp.write(builder.error_event(error))
    with contextlib.suppress(ConnectionResetError):
        await resp.write(builder.close())
        await resp.write_eof()
    return resp, "aborted" if outcome == "ok" and flight.aborted else outcome


async def _write_outputs(resp, flight: Flight, builder: Builder, outputs, counts) -> None:
    chunks = []
    for i, o in outputs:
        counts[i] += len(o.token_ids)
        if not (flight.timed_out and o.finish_reason == "abort"):
            chunks.append(builder.delta_chunk(i, o))
    if any(chunks):
        await resp.write(b"".join(chunks))


async def _collect(flight: Flight, builder: Builder, n: int):
    merged: dict[int, RequestOutput] = {}
    try:
        while (item := await flight.next()) is not None:
            k, delta = item
            if k not in merged:
                merged[k] = RequestOutput(delta.request_id, None, [], [])
            merged[k].merge(delta)
            if builder.extras is not None:
                builder.extras.feed(k, delta)  # prompt logprobs
    except (EngineDeadError, InvalidParameter) as e:
        raise _as_api_error(e)[1] from None
    if flight.timed_out and flight.aborted:
        raise _timeout_error()
    choices = [(k * n + o.index, o) for k in sorted(merged) for o in merged[k].outputs]
    num_completion = sum(len(o.token_ids) for _, o in choices)
    body = builder.response(choices, flight.usage(num_completion))
    return json_response(body), "aborted" if flight.aborted else "ok"


def _as_api_error(e: Exception) -> tuple[str, APIError]:
    if isinstance(e, APIError):
        return ("rejected" if e.status < 500 else "error"), e
    if isinstance(e, InvalidParameter):
        return "rejected", bad(e.param, str(e))
    log.error("engine error: %s", e.__cause__ or e)
    return "error", APIError(
        500, "The engine stopped after an error.", type="server_error", code="engine_dead"
    )


def _timeout_error() -> APIError:
    return APIError(
        408,
        "The request exceeded the server's request timeout.",
        type="timeout_error",
        code="request_timeout",
    )
