"""The server's HTTP plumbing: API key and CORS gate, OpenAI error shape for every failure, and
JSON body reading with its limits.

The API key is checked on every route but `/health` (decided on the resolved route, never on the
path string), with a constant-time compare. CORS is off unless origins are listed; a listed
origin is echoed back, never `*`, never with credentials. No traceback ever reaches a client.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tinyserve.serve.protocol import APIError
from tinyserve.serve.responses import dumps

log = logging.getLogger("tinyserve.serve.server")
PUBLIC_ROUTE = "health"  # the route name that needs no API key (GET and HEAD)


def gate(api_key: str | None, allowed_origin: tuple[str, ...], on_reject: Callable) -> Callable:
    """Answers CORS preflights from listed origins; refuses requests without the API key."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if (
            request.method == "OPTIONS"
            and request.headers.get("Origin") in allowed_origin
            and "Access-Control-Request-Method" in request.headers
        ):  # a CORS preflight: browsers never send credentials on it
            return web.Response(
                status=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600",
                },
            )
        if api_key is not None and not _is_public(request) and not _authorized(request, api_key):
            on_reject()
            return error_response(
                APIError(
                    401,
                    "Missing or invalid API key (send 'Authorization: Bearer <key>').",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="tinyserve"'},
                )
            )
        return await handler(request)

    return middleware


def _is_public(request: web.Request) -> bool:
    # The resolved route, not the path string: no '//health' or '%2F' tricks.
    route = request.match_info.route
    return route.name == PUBLIC_ROUTE and request.method in ("GET", "HEAD")


def _authorized(request: web.Request, api_key: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


def cors_headers(allowed_origin: tuple[str, ...]) -> Callable:
    """An on_response_prepare hook, so streamed and error responses get the headers too."""

    async def hook(request: web.Request, response: web.StreamResponse) -> None:
        if allowed_origin:
            response.headers["Vary"] = "Origin"
            origin = request.headers.get("Origin")
            if origin in allowed_origin:
                response.headers["Access-Control-Allow-Origin"] = origin

    return hook


def errors(count: Callable[[str], None]) -> Callable:
    """Turns every failure into `{"error": {...}}`; `count(outcome)` feeds the metrics."""

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            outcome = "timeout" if e.code == "request_timeout" else "rejected"
            count(outcome if e.status < 500 else "error")
            if e.status != 429:
                log.info("%s %r -> %d %s", request.method, request.path, e.status, e.code)
            return error_response(e)
        except web.HTTPException as e:  # no route (404), wrong method (405)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            headers = {k: v for k, v in e.headers.items() if k == "Allow"}
            return error_response(
                APIError(e.status, e.reason, code=code.get(e.status), headers=headers)
            )
        except Exception:  # a bug: log it, never send the traceback
            log.exception("internal error in %s %r", request.method, request.path)
            count("error")
            return error_response(APIError(500, "Internal server error.", type="server_error"))

    return middleware


def error_response(e: APIError) -> web.Response:
    resp = web.Response(status=e.status, body=dumps(e.body), content_type="application/json")
    resp.headers.update(e.headers)
    return resp


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(obj), content_type="application/json")


async def read_json(request: web.Request) -> Any:
    """The body as JSON: 415 for another content type, 413 past client_max_size, 400 if bad."""
    if "Content-Type" in request.headers and not (
        request.content_type == "application/json" or request.content_type.endswith("+json")
    ):
        raise APIError(415, "Content-Type must be application/json.", code="unsupported_media")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:  # e.text: "Maximum request body size ..."
        raise APIError(413, e.text, code="request_too_large") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, 4300+ digit ints, deep nesting
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
