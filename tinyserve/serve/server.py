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
import signal
from collections.abc import Callable

from aiohttp import web

from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.sampling_params import InvalidParameter
from tinyserve.serve import generate, messages_api, protocol, responses_api
from tinyserve.serve.chat_template import render_chat
from tinyserve.serve.errors import APIError, bad
from tinyserve.serve.metrics import CONTENT_TYPE
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
from tinyserve.serve.state import (  # noqa: F401 (re-exported: the server's public names)
    STATE,
    ServerConfig,
    ServerState,
    generation_defaults,
    served_names,
)
from tinyserve.serve.web_ui import add_web_ui

log = logging.getLogger("tinyserve.serve.server")

try:
    VERSION = importlib.metadata.version("tinyserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "unknown"


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
    r.add_post("/v1/responses", responses_api.create, **expect)
    r.add_get("/v1/responses/{response_id}", responses_api.retrieve, **expect)
    r.add_delete("/v1/responses/{response_id}", responses_api.delete, **expect)
    r.add_post("/v1/messages", messages_api.create, **expect)
    r.add_post("/v1/messages/count_tokens", messages_api.count_tokens, **expect)
    r.add_get("/v1/models", models, **expect)
    r.add_get("/v1/models/{model}", model_card, **expect)
    r.add_get("/health", health, name=PUBLIC_ROUTE, **expect)
    r.add_get("/version", version, **expect)
    r.add_get("/metrics", metrics, **expect)
    r.add_post("/tokenize", tokenize, **expect)
    r.add_post("/detokenize", detokenize, **expect)
    if config.web_ui:
        add_web_ui(app)  # before the catch-all below, which would answer "/" too
    r.register_resource(Unrouted(r))  # last: 404 / 405 with the same Expect handler
    app.on_response_prepare.append(cors_headers(config.allowed_origin))
    return app


# -- routes ---------------------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    req = protocol.parse_chat(await read_json(request), st.info)
    return await generate.run_chat(request, req, arrival)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = asyncio.get_running_loop().time()
    st = request.app[STATE]
    req = protocol.parse_completion(await read_json(request), st.info)
    st.check_admission(len(req.prompts))
    await generate.prepare_grammar(st, req)
    ids = []
    for p in req.prompts:
        if isinstance(p, list):
            ids.append(p)
        else:
            ids.append(await generate.offload(st.require_tokenizer("prompt").encode, len(p), p))

    def make(prompt_ids: list[list[int]], truncated: list[bool]) -> generate.Builder:
        return generate.chat_builder(st, req, False, prompt_ids, truncated)

    return await generate.generate(request, req, ids, arrival, make)


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
        ids = await generate.offload(st.tokenizer.encode, len(what), what, add_special)
    else:
        num_chars = sum(len(m["content"]) for m in what)
        try:
            ids, _ = await generate.offload(
                render_chat, num_chars, st.tokenizer, what, None, options
            )
        except InvalidParameter as e:
            raise bad(e.param, str(e)) from None
    return json_response({"count": len(ids), "max_model_len": st.info.max_model_len, "tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    ids = protocol.parse_detokenize(await read_json(request), st.info)
    st.require_tokenizer("tokens")
    text = await generate.offload(st.tokenizer.decode, len(ids), ids)
    return json_response({"prompt": text})


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
