"""The server's HTTP plumbing: Host, API key and CORS gate, OpenAI error shape for every failure,
and JSON body reading with its limits.

Every route but `/health` (decided on the resolved route, never on the path string) needs a Host
header that names this server (DNS rebinding) and, when one is set, the API key (constant-time
compare; the chat page's GET routes load without it, since the page asks for it), sent as
`Authorization: Bearer KEY` or as Anthropic's `x-api-key: KEY`. POST bodies must be
`application/json`, so a web page cannot send one without a CORS preflight; CORS is off unless
origins are listed, and a listed origin is echoed back, never `*`, never with credentials.
`100 Continue` goes out only once all of that passed. No traceback ever reaches a client, and a
client's mistake never logs one. Errors take OpenAI's shape, or Anthropic's on /v1/messages.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import sys
import zlib
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tinyserve.serve.errors import APIError
from tinyserve.serve.responses import dumps
from tinyserve.serve.web_ui import PAGE_ROUTES

log = logging.getLogger("tinyserve.serve.server")
PUBLIC_ROUTE = "health"  # the route name that needs no API key or local Host (GET and HEAD)
LOCAL_NAMES = ("localhost",)  # and its subdomains (RFC 6761); address literals are always local


def gate(
    api_key: str | None,
    allowed_origin: tuple[str, ...],
    allowed_host: tuple[str, ...],
    on_reject: Callable,
) -> Callable:
    """Answers CORS preflights from listed origins; refuses requests whose Host header names
    another server, then requests without the API key."""

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
                    "Access-Control-Allow-Headers": (
                        "Authorization, Content-Type, X-Api-Key, Anthropic-Version"
                    ),
                    "Access-Control-Max-Age": "600",
                },
            )
        if _is_routed(request) and not _is_public(request):
            host = request.headers.get("Host")
            if not is_allowed_host(host, allowed_host):
                on_reject()
                shown = repr(host if len(host) <= 64 else host[:61] + "...")
                log.info("refused Host %s", shown)
                return error_response(
                    request,
                    APIError(
                        400,
                        f"The Host header {shown} does not name this server (a DNS rebinding "
                        f"guard); start it with --allowed-host NAME to serve that name.",
                        code="invalid_host",
                    ),
                )
        if (
            api_key is not None
            and not _is_public(request)
            and not _is_page(request)
            and not _authorized(request, api_key)
        ):
            on_reject()
            return error_response(
                request,
                APIError(
                    401,
                    "Missing or invalid API key (send 'Authorization: Bearer <key>' or "
                    "'x-api-key: <key>').",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="tinyserve"'},
                ),
            )
        return await handler(request)

    return middleware


def _is_public(request: web.Request) -> bool:
    # The resolved route, not the path string: no '//health' or '%2F' tricks.
    route = request.match_info.route
    return route.name == PUBLIC_ROUTE and request.method in ("GET", "HEAD")


def _is_page(request: web.Request) -> bool:
    """The chat page and its files load without the key (the page asks for it)."""
    return request.match_info.route.name in PAGE_ROUTES and request.method in ("GET", "HEAD")


def _is_routed(request: web.Request) -> bool:
    """A route of the API, not a 404 / 405 answer (which serves nothing)."""
    match = request.match_info
    return match.http_exception is None and not isinstance(match.route.resource, Unrouted)


def credential(request: web.Request) -> str | None:
    """The key the client sent: a Bearer token, else Anthropic's x-api-key header."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key")


def _authorized(request: web.Request, api_key: str) -> bool:
    key = credential(request)
    # aiohttp decodes header bytes that are not UTF-8 as surrogate escapes: compare bytes.
    return key is not None and hmac.compare_digest(
        key.encode(errors="surrogateescape"), api_key.encode()
    )


_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:]+)(?::[0-9]{1,5})?")


def is_allowed_host(host: str | None, allowed_host: tuple[str, ...]) -> bool:
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 sends
    `Host: evil.example`. Allowed: no Host (HTTP/1.0, no browser), address literals (a page at an
    address cannot be rebound), localhost and *.localhost, then `allowed_host`: exact names,
    `.example.com` for it and its subdomains, `*` for any."""
    if host is None or "*" in allowed_host:
        return True
    match = _HOST.fullmatch(host)
    if match is None:
        return False
    name = match.group(1).lower().removesuffix(".")  # "localhost." is localhost
    literal = name[1:-1] if name.startswith("[") else name
    try:
        ipaddress.ip_address(literal)
        return True
    except ValueError:
        if name.startswith("["):
            return False
    if any(name == n or name.endswith("." + n) for n in LOCAL_NAMES):
        return True
    return any(
        name == a or (a.startswith(".") and (name == a[1:] or name.endswith(a)))
        for a in allowed_host
    )


async def expect_continue_later(request: web.Request) -> web.StreamResponse | None:
    """The routes' Expect handler. aiohttp's default sends `100 Continue` before any middleware
    runs, inviting the body of a request that the API key check will refuse; `read_json` sends
    it once the checks passed and the body is about to be read."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        return error_response(
            request,
            APIError(417, "Only 'Expect: 100-continue' is supported.", code="expectation_failed"),
        )
    return None


class Unrouted(web.AbstractResource):
    """The router's last resource: whatever no route matched gets aiohttp's 404 or 405 (with
    Allow), but through a route of ours, whose Expect handler defers 100 Continue. aiohttp's
    own answer would send it before any middleware, to a client without the API key. Lists no
    routes: `router.routes()` shows the API alone."""

    def __init__(self, router: web.UrlDispatcher) -> None:
        super().__init__()
        self._router = router

    @property
    def canonical(self) -> str:
        return "/"  # indexed at "/", which the router tries after every longer prefix

    async def resolve(self, request: web.Request) -> tuple[web.UrlMappingMatchInfo, set[str]]:
        allowed: set[str] = set()
        for resource in self._router.resources():
            if resource is not self:
                allowed |= (await resource.resolve(request))[1]
        error = web.HTTPMethodNotAllowed(request.method, allowed) if allowed else web.HTTPNotFound()

        async def handler(request: web.Request) -> web.StreamResponse:
            raise error

        route = web.ResourceRoute("*", handler, self, expect_handler=expect_continue_later)
        return web.UrlMappingMatchInfo({}, route), allowed

    def url_for(self, **kwargs: str):
        raise RuntimeError("Unrouted has no URL")

    def add_prefix(self, prefix: str) -> None:
        raise RuntimeError("Unrouted takes no prefix")

    def get_info(self) -> dict:
        return {}

    def raw_match(self, path: str) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def __iter__(self):
        return iter(())


class ClientErrorLog(logging.LoggerAdapter):
    """aiohttp's server logger (RequestHandler's `logger`), where a client's malformed request (a
    bad request line, headers too long, broken chunked framing, TLS to the plain port) is one
    line at INFO at most, without a traceback; anything else is logged as aiohttp logs it."""

    def log(self, level, msg, *args, exc_info=None, **kwargs) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if exc_info is True:
            exc = sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            level = min(level, logging.INFO)
            msg, args, exc_info = msg + ": %r", (*args, str(exc)), None  # %r: no forged lines
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)


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
            return error_response(request, e)
        except web.HTTPException as e:  # no route (404), wrong method (405)
            code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
            headers = {k: v for k, v in e.headers.items() if k == "Allow"}
            return error_response(
                request, APIError(e.status, e.reason, code=code.get(e.status), headers=headers)
            )
        except Exception:  # a bug: log it, never send the traceback
            log.exception("internal error in %s %r", request.method, request.path)
            count("error")
            return error_response(
                request, APIError(500, "Internal server error.", type="server_error")
            )

    return middleware


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic(request: web.Request) -> bool:
    """The Anthropic API's routes answer errors in its shape."""
    return request.path == "/v1/messages" or request.path.startswith("/v1/messages/")


def anthropic_error(e: APIError) -> dict:
    kind = ANTHROPIC_ERRORS.get(
        e.status, "api_error" if e.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(request: web.Request, e: APIError) -> web.Response:
    body = anthropic_error(e) if is_anthropic(request) else e.body
    resp = web.Response(status=e.status, body=dumps(body), content_type="application/json")
    resp.headers.update(e.headers)
    return resp


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(obj), content_type="application/json")


_IDENTITY = ("", "identity")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": None}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: web.Request) -> Any:
    """The body as JSON: 415 unless `application/json` (charset utf-8 if given) or for an unknown
    Content-Encoding, 413 past client_max_size (compressed or not), 400 if not UTF-8 JSON or if
    a string holds a lone surrogate. The app runs with aiohttp's auto_decompress off: this
    decodes gzip / deflate itself, bounded, with errors a client can read."""
    if (
        "Content-Type" not in request.headers
        or request.content_type != "application/json"
        or (request.charset or "utf-8").lower() != "utf-8"
    ):
        raise APIError(
            415,
            "Content-Type must be application/json (charset utf-8, if any).",
            code="unsupported_media",
        )
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in _IDENTITY and encoding not in _WBITS:
        raise APIError(
            415,
            "Content-Encoding must be gzip, deflate or identity.",
            code="unsupported_content_encoding",
        )
    limit = request.client_max_size
    too_large = APIError(
        413, f"The request body is larger than {limit} bytes.", code="request_too_large"
    )
    if (request.content_length or 0) > limit:  # refused before 100 Continue invites it
        raise too_large
    if request.headers.get("Expect", "").lower() == "100-continue":
        if request.version >= HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # what aiohttp's own Expect handler does
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except RequestPayloadError:  # broken chunked framing, a body cut short
        raise APIError(400, "The request body is malformed.", code="invalid_body") from None
    if encoding not in _IDENTITY:
        raw = _decompress(raw, encoding, limit, too_large)
    try:
        text = raw.decode()
        body = json.loads(text)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, 4300+ digit ints, deep nesting
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: only a \uD800-\uDFFF escape makes one
        _check_unicode(body)
    return body


def _decompress(raw: bytes, encoding: str, limit: int, too_large: APIError) -> bytes:
    wbits = _WBITS[encoding]
    if wbits is None:  # deflate: zlib-wrapped as the RFC says, or raw as some clients send it
        wbits = zlib.MAX_WBITS if raw[:1] and raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, limit + 1)  # a compression bomb stops here
    except zlib.error:
        out = None
    if out is not None and len(out) > limit:
        raise too_large
    if out is None or not d.eof or d.unused_data:
        raise APIError(
            400, f"The request body is not valid {encoding} data.", code="invalid_content_encoding"
        )
    return out


def _check_unicode(body: Any) -> None:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`): no valid text, and the tokenizer and
    UTF-8 encoders fail on it. Valid pairs were joined by the parser and strict UTF-8 decoding
    rules out the rest, so any surrogate left is a lone one. `param`: the top-level field."""
    for key, value in body.items() if isinstance(body, dict) else [(None, body)]:
        if _has_surrogate(key) or _has_surrogate(value):
            raise APIError(
                400,
                "The request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff): "
                "strings must be valid Unicode.",
                None if _has_surrogate(key) else key,
                "invalid_unicode",
            )


def _has_surrogate(value: Any) -> bool:
    stack = [value]  # no recursion: nesting is as deep as json.loads allowed
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return True
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, list):
            stack += x
    return False
