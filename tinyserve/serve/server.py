"""OpenAI-compatible HTTP server (aiohttp): routes, SSE, auth, CORS, limits, deadlines, drain.

`build_app(engine, config)` returns the application; `serve(engine, config)` runs it until SIGTERM
or SIGINT (graceful drain within `shutdown_timeout`, exit code 0) or a fatal engine error (exit
code 1, for a supervisor to restart). The loop never waits on model work: the engine steps in its
worker thread and large prompts are tokenized in the default executor. Handler cancellation must
be on (serve() and aiohttp's TestServer do it): a client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.metadata
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tinyserve.engine.async_engine import AsyncEngine, EngineDeadError
from tinyserve.model.config import sampling_defaults
from tinyserve.model.tokenizer import ChatTemplateError, Tokenizer
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import InvalidParameter
from tinyserve.serve import echo, protocol, structured
from tinyserve.serve.flight import Flight
from tinyserve.serve.metrics import CONTENT_TYPE, ServerMetrics
from tinyserve.serve.middleware import (
    PUBLIC_ROUTE,
    ClientErrorLog,
    Unrouted,
    cors_headers,
    errors,
    expect_continue_later,
    gate,
    json_response,
    read_json,
)
from tinyserve.serve.protocol import APIError, GenerateRequest, ModelInfo
from tinyserve.serve.responses import DONE, ResponseBuilder, sse

log = logging.getLogger("tinyserve.serve.server")

OFFLOAD_CHARS = 8_192  # tokenize longer inputs in the executor (~3 ms of work on the loop)
try:
    VERSION = importlib.metadata.version("tinyserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "unknown"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


@dataclass(slots=True)
class ServerConfig:
    served_model_name: tuple[str, ...] = ()  # default: the model directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required on every route but /health when set
    allowed_origin: tuple[str, ...] = ()  # CORS is off unless origins are listed
    max_waiting: int = 1024  # requests without their first token yet; more get 429
    request_timeout: float | None = None  # seconds from arrival; None = no deadline
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish after SIGTERM
    clamp_max_tokens: bool = False  # shrink max_tokens to fit the context instead of a 400
    max_body_bytes: int = 1 << 20
    # Host header names served besides local ones (DNS rebinding guard): exact names,
    # ".example.com" for it and its subdomains, "*" for any.
    allowed_host: tuple[str, ...] = ()
    # Seconds a client has to send a request's headers, from the connect or its previous
    # response (slowloris); an idle keep-alive connection is closed after it too.
    header_timeout: float = 10.0
    # Defaults for the sampling fields a request leaves unset (temperature, top_p, top_k, min_p,
    # repetition_penalty; max_new_tokens caps an unset max_tokens), vLLM's: "auto" from the
    # model's generation_config.json, "vllm" none, or a directory holding such a file.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        self.served_model_name = tuple(self.served_model_name)
        self.allowed_origin = tuple(self.allowed_origin)
        self.allowed_host = tuple(h.strip().lower() for h in self.allowed_host)
        if "*" in self.allowed_origin:
            raise ValueError("allowed_origin: list origins explicitly ('*' is not allowed)")
        if not all(self.allowed_host):
            raise ValueError("allowed_host: names must be non-empty")
        special = ("auto", "vllm")
        if self.generation_config not in special and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config: 'auto', 'vllm' or a directory, got {self.generation_config!r}"
            )
        if not self.header_timeout > 0:
            raise ValueError(f"header_timeout: must be > 0, got {self.header_timeout}")
        for name, low in [
            ("max_waiting", 1),
            ("max_body_bytes", 1),
            ("port", 0),
            ("request_timeout", 0),
            ("shutdown_timeout", 0),
        ]:
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")


def generation_defaults(config: ServerConfig, model: str) -> dict[str, Any]:
    """The request defaults `generation_config` names: the generation_config.json of the model
    ("auto"), of another directory, or none ("vllm"); ValueError for a file with bad values."""
    if config.generation_config == "vllm":
        return {}
    source = model if config.generation_config == "auto" else config.generation_config
    return sampling_defaults(source)


def served_names(config: ServerConfig, model: str) -> tuple[str, ...]:
    """The names clients may send; the first is reported (default: the model directory's)."""
    return config.served_model_name or (model.rstrip("/").rsplit("/", 1)[-1],)


class ServerState:
    """Everything the handlers share (one per app)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        llm = engine.engine
        self.engine, self.config, self.tokenizer = engine, config, llm.tokenizer
        model = self.model_path = llm.config.model
        self.served = served_names(config, model)
        vocab = self.tokenizer.backend.get_vocab() if self.tokenizer else {}
        longest = max(map(len, vocab), default=1)
        defaults = generation_defaults(config, model)
        if defaults:
            log.info("default sampling params (--generation-config): %s", defaults)
        self.info = ModelInfo(
            self.served + (model,),
            llm.max_model_len,
            llm.model_config.vocab_size,
            max(1, longest),
            defaults,
        )
        self.metrics = ServerMetrics(llm, self.served[0])
        self.flights: set[Flight] = set()
        self.num_waiting = 0  # engine requests without their first output yet (backpressure)
        self.draining = False
        self.created = int(time.time())

    def require_tokenizer(self, param: str) -> Tokenizer:
        """Checkpoints without tokenizer.json (dummy benchmark shapes) serve token ids only."""
        if self.tokenizer is None:
            raise protocol.bad(param, "this model has no tokenizer: send token ids as the prompt")
        return self.tokenizer

    def check_admission(self, num_requests: int) -> None:
        if not self.engine.is_running:
            raise APIError(
                503,
                "The engine stopped after an error; the server is restarting.",
                type="server_error",
                code="engine_dead",
            )
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down.",
                type="server_error",
                code="shutting_down",
                headers={"Connection": "close"},
            )
        if self.num_waiting + num_requests > self.config.max_waiting:
            raise APIError(
                429,
                f"Too many requests are waiting ({self.num_waiting}); retry later.",
                type="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": "1"},
            )


STATE = web.AppKey("state", ServerState)


def build_app(engine: AsyncEngine, config: ServerConfig) -> web.Application:
    st = ServerState(engine, config)
    reject = functools.partial(st.metrics.count, "rejected")
    hosts = config.allowed_host + (config.host.lower(),)  # the bound name, when it is one
    middlewares = [
        gate(config.api_key, config.allowed_origin, hosts, reject),
        errors(st.metrics.count),
    ]
    # Arguments of each connection's aiohttp RequestHandler, wherever the app runs (serve(),
    # TestServer). read_json decodes Content-Encoding itself (OpenAI-shaped errors, a bounded
    # inflate). aiohttp's keep-alive timer is armed at the connect and after each response and
    # closes a connection still waiting for a complete request: the header timeout.
    handler_args = {
        "auto_decompress": False,
        "keepalive_timeout": config.header_timeout,
        "logger": ClientErrorLog(logging.getLogger("aiohttp.server")),
    }
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=middlewares, handler_args=handler_args
    )
    app[STATE] = st
    r = app.router
    expect = {"expect_handler": expect_continue_later}  # 100 Continue only once the checks pass
    r.add_post("/v1/chat/completions", chat_completions, **expect)
    r.add_post("/v1/completions", completions, **expect)
    r.add_get("/v1/models", models, **expect)
    r.add_get("/v1/models/{model}", model_card, **expect)
    r.add_get("/health", health, name=PUBLIC_ROUTE, **expect)
    r.add_get("/version", version, **expect)
    r.add_get("/metrics", metrics, **expect)
    r.add_post("/tokenize", tokenize, **expect)
    r.add_post("/detokenize", detokenize, **expect)
    r.register_resource(Unrouted(r))  # last: 404 / 405 with the same Expect handler
    app.on_response_prepare.append(cors_headers(config.allowed_origin))
    return app


async def _offload(fn: Callable, num_chars: int, *args) -> Any:
    if num_chars < OFFLOAD_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# -- routes ---------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    req = protocol.parse_chat(await read_json(request), st.info)
    st.check_admission(1)  # cheap refusals before tokenizing
    num_chars = sum(len(m["content"]) for m in req.messages)
    tokenizer = st.require_tokenizer("messages")
    await _prepare_grammar(st, req)
    tools = req.tools.tools if req.tools is not None else None
    messages, options = req.messages, req.render_options
    ids = await _offload(_render_chat, num_chars, tokenizer, messages, tools, options)
    return await _generate(request, req, [ids], arrival, chat=True)


async def _prepare_grammar(st: ServerState, req: GenerateRequest) -> None:
    """Compile the request's structured-output grammar off the loop before anything is queued:
    an invalid schema, regex or grammar is a 400 here."""
    try:
        await structured.prepare(st.engine, req, st.tokenizer)
    except InvalidParameter as e:
        raise protocol.bad(e.param, str(e)) from None


def _render_chat(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None
) -> list[int]:
    """The prompt's ids; `tools` reach the template's own `tools` variable (as vLLM: a template
    that ignores them renders none); `options`: protocol.render_options."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, **(options or {}))
    except ChatTemplateError as e:
        raise protocol.bad("messages", str(e)) from None
    return tokenizer.encode(text, add_special_tokens=False)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    req = protocol.parse_completion(await read_json(request), st.info)
    st.check_admission(len(req.prompts))
    await _prepare_grammar(st, req)
    ids = []
    for p in req.prompts:
        if isinstance(p, list):
            ids.append(p)
        else:
            ids.append(await _offload(st.require_tokenizer("prompt").encode, len(p), p))
    return await _generate(request, req, ids, arrival, chat=False)


async def _generate(
    request: web.Request,
    req: GenerateRequest,
    prompt_ids: list[list[int]],
    arrival: float,
    chat: bool,
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
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    builder = ResponseBuilder(
        chat, rid, int(time.time()), st.served[0], st.tokenizer, req.top_logprobs, req.include_usage
    )
    if chat and req.tools is not None:
        builder.tools = req.tools.streams()  # tool_calls parsed out of each choice's text
    builder.extras = echo.extras_for(builder, req, prompt_ids, truncated)
    timeout = st.config.request_timeout
    deadline = None if timeout is None else arrival + timeout
    flight = Flight(st, rid, prompt_ids, params, deadline, req.cache_salt)
    outcome = None  # an APIError raised from here is counted by the _errors middleware
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


async def _stream(request, flight: Flight, builder: ResponseBuilder, n: int):
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    counts = [0] * (flight.num_prompts * n)
    outcome, error = "ok", None
    try:
        if builder.chat:
            await resp.write(b"".join(builder.role_chunk(i) for i in range(len(counts))))
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
        elif builder.include_usage:
            await resp.write(builder.usage_chunk(flight.usage(sum(counts))))
    except ConnectionResetError:  # the client went away while we wrote
        return resp, "aborted"
    except (EngineDeadError, InvalidParameter, APIError) as e:
        outcome, error = _as_api_error(e)
    except Exception:  # a bug in this request's post-processing: only this request fails
        log.exception("error while streaming %s", builder.id)
        outcome, error = "error", APIError(500, "Internal server error.", type="server_error")
    if error is not None:  # after the headers went out, an error is an SSE event
        with contextlib.suppress(ConnectionResetError):
            await resp.write(sse(error.body))
    with contextlib.suppress(ConnectionResetError):
        await resp.write(DONE)
        await resp.write_eof()
    return resp, "aborted" if outcome == "ok" and flight.aborted else outcome


async def _write_outputs(resp, flight: Flight, builder: ResponseBuilder, outputs, counts) -> None:
    chunks = []
    for i, o in outputs:
        counts[i] += len(o.token_ids)
        if not (flight.timed_out and o.finish_reason == "abort"):
            chunks.append(builder.delta_chunk(i, o))
    if any(chunks):
        await resp.write(b"".join(chunks))


async def _collect(flight: Flight, builder: ResponseBuilder, n: int):
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
        return "rejected", protocol.bad(e.param, str(e))
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


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return json_response({"object": "list", "data": [_card(st, name) for name in st.served]})


async def model_card(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["model"]
    if name not in st.served:
        raise APIError(404, "The model does not exist.", "model", "model_not_found")
    return json_response(_card(st, name))


def _card(st: ServerState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": st.created,
        "owned_by": "tinyserve",
        "root": st.model_path,  # vLLM's: the served checkpoint's directory
        "parent": None,
        "max_model_len": st.info.max_model_len,
    }


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def health(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if not st.engine.is_running:
        return json_response({"status": "engine_dead"}, 503)
    if st.draining:
        return json_response({"status": "draining"}, 503)
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE}
    )


async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    what, add_special, options = protocol.parse_tokenize(await read_json(request), st.info)
    st.require_tokenizer("prompt")
    if isinstance(what, str):
        ids = await _offload(st.tokenizer.encode, len(what), what, add_special)
    else:
        num_chars = sum(len(m["content"]) for m in what)
        ids = await _offload(_render_chat, num_chars, st.tokenizer, what, None, options)
    return json_response({"count": len(ids), "max_model_len": st.info.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    ids = protocol.parse_detokenize(await read_json(request), st.info)
    st.require_tokenizer("tokens")
    return json_response({"prompt": await _offload(st.tokenizer.decode, len(ids), ids)})


# -- running: signals, drain, fatal errors --------------------------------------------------------

# Seconds the handlers get to write their last chunks once the drain ended their requests (they
# wait on the loop only; a client that reads nothing is cut by the runner's cleanup after it).
DRAIN_WRITE_S = 2.0


async def drain(app: web.Application, timeout: float) -> None:
    """Refuse new requests (503), let in-flight ones finish for `timeout` s, then end the rest at
    once: each gets its final chunk with finish_reason "abort" and `data: [DONE]` (a complete
    body when not streaming) without waiting for the engine's step, which frees their blocks at
    its next one. Returns when every handler wrote its end (or after DRAIN_WRITE_S)."""
    st = app[STATE]
    st.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while st.flights and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for flight in list(st.flights):
        flight.end()
    deadline = loop.time() + DRAIN_WRITE_S
    while st.flights and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def serve(
    engine: AsyncEngine, config: ServerConfig, on_ready: Callable[[str], None] | None = None
) -> int:
    """Serve until SIGTERM/SIGINT (drain, return 0) or a fatal engine error (return 1)."""
    app = build_app(engine, config)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        engine.start()
        # A full collection walks every live object: ~195k once a model is up (its modules,
        # the kernels, the libraries), 55 ms on a 2-core CPU, in which no stream steps. They
        # live as long as the server, so they leave the collector's reach until it returns.
        gc.collect()
        gc.freeze()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        host, port = runner.addresses[0][:2]
        if on_ready is not None:
            on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")
        while not stop.is_set() and engine.is_running:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
        if engine.is_running:
            log.info("shutting down: draining for up to %.1f s", config.shutdown_timeout)
            await drain(app, config.shutdown_timeout)
            return 0
        log.error("the engine stopped after an error; exiting", exc_info=engine.error)
        app[STATE].draining = True
        await drain(app, 1.0)  # in-flight requests get their error events
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # A repeated SIGTERM during the rest of the shutdown (cleanup, interpreter exit) must not
        # turn a clean exit into a kill; SIGINT keeps its default so Ctrl-C can still force it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await runner.cleanup()
        await engine.close()
        gc.unfreeze()  # serve() may run again in this process (tests), with another engine
