"""API key coverage, CORS, log injection and no unsafe deserialization (checklist 19, 20 and the
supplementary checks). Tricky paths and headers go over a raw socket so nothing normalizes them.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import re

import pytest
from test_server import CHAT, serving

pytestmark = pytest.mark.slow

KEY = "sekret-key-123"
GOOD_BODIES = {
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1]},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": CHAT, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": CHAT},
}
PAGE = ("/", "/static/app.js")  # the chat page loads without the key: it asks for it


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


async def raw(client, request: str) -> tuple[int, dict[str, str], str]:
    """Send a hand-written HTTP/1.1 request; return (status, headers lower-cased, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(request.replace("\n", "\r\n").encode() + b"\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body.decode(errors="replace")


def routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.router.routes():
        path = route.resource.canonical.replace("{model}", "SmolLM2-135M-Instruct")
        path = path.replace("{name}", "app.js").replace("{response_id}", "resp_unknown")
        out.append((route.method, path))
    return out


def test_19_api_key_on_every_route_but_health(engine, caplog):
    caplog.set_level(logging.DEBUG)

    async def go():
        async with serving(engine, api_key=KEY) as client:
            table = routes(client.app)
            assert len(table) >= 12  # every route, GET ones with their HEAD twin
            for method, path in table:
                public = path in ("/health", *PAGE) and method in ("GET", "HEAD")
                for headers in (
                    {},
                    {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {KEY}x"},
                ):
                    r = await client.request(
                        method, path, headers=headers, json=GOOD_BODIES.get(path)
                    )
                    if public:
                        assert r.status == 200, (method, path)
                    else:
                        assert r.status == 401, (method, path, headers)
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                        if method != "HEAD":
                            body = await r.json()
                            if path.startswith("/v1/messages"):  # Anthropic's error shape
                                assert body["error"]["type"] == "authentication_error"
                            else:
                                assert body["error"]["code"] == "invalid_api_key"
                            assert KEY not in await r.text()
                for auth in (f"Bearer {KEY}", f"bearer {KEY}"):
                    r = await client.request(
                        method, path, headers={"Authorization": auth}, json=GOOD_BODIES.get(path)
                    )
                    # An unknown stored response is a 404 once the key passed.
                    ok = 404 if "resp_unknown" in path else 200
                    assert r.status == ok, (method, path, await r.text())
            probes = [
                "POST //v1/chat/completions HTTP/1.1",
                "GET /v1/../v1/models HTTP/1.1",
                "GET /v1/./models HTTP/1.1",
                "GET /%2Fv1%2Fmodels HTTP/1.1",
                "GET /v1%2Fmodels HTTP/1.1",
                "GET /health/../v1/models HTTP/1.1",
                "GET /health%2F..%2Fv1%2Fmodels HTTP/1.1",
                "GET /v1/models?x=/health HTTP/1.1",
                "GET http://127.0.0.1/v1/models HTTP/1.1",
                "HEAD /v1/models HTTP/1.1",
                "OPTIONS /v1/models HTTP/1.1",
                "OPTIONS * HTTP/1.1",
                "POST /health HTTP/1.1",
                "DELETE /health HTTP/1.1",
            ]
            for line in probes:
                for extra in (
                    "",
                    "X-Forwarded-For: 127.0.0.1\nX-Real-IP: 127.0.0.1\n"
                    "X-Forwarded-Host: localhost\nX-Forwarded-Proto: https\n"
                    "Forwarded: for=127.0.0.1\n",
                ):
                    request = (
                        f"{line}\nHost: localhost\n{extra}Content-Length: 0\nConnection: close\n"
                    )
                    status, headers, _ = await raw(client, request)
                    assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (
                        line,
                        status,
                    )
            status, _, _ = await raw(
                client,
                "GET /health HTTP/1.1\nHost: evil.example\n"
                "Authorization: Bearer nope\nConnection: close\n",
            )
            assert status == 200

    asyncio.run(go())
    assert KEY not in caplog.text


def test_20_cors_off_by_default_and_exact_origin_echo(engine):
    ok, evil = "https://ok.example", "https://evil.example"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }

    async def go(**config):
        async with serving(engine, **config) as client:
            out = {}
            for origin in (ok, evil):
                r = await client.options(
                    "/v1/chat/completions", headers={"Origin": origin, **preflight}
                )
                out["preflight", origin] = r.status, dict(r.headers)
                r = await client.get(
                    "/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}
                )
                out["get", origin] = r.status, dict(r.headers)
                r = await client.post(
                    "/v1/chat/completions",
                    json={**GOOD_BODIES["/v1/chat/completions"], "stream": True},
                    headers={"Origin": origin, "Authorization": f"Bearer {KEY}"},
                )
                await r.read()
                out["stream", origin] = r.status, dict(r.headers)
            return out

    default = asyncio.run(go())
    for (_, origin), (status, headers) in default.items():
        assert "Access-Control-Allow-Origin" not in headers, (origin, status)
    assert default["preflight", ok][0] == 405  # no OPTIONS route: CORS is simply off

    on = asyncio.run(go(allowed_origin=(ok,), api_key=KEY))
    status, headers = on["preflight", ok]
    assert status == 204  # no key needed: browsers never send credentials on a preflight
    assert headers["Access-Control-Allow-Origin"] == ok
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    assert on["preflight", evil][0] == 401  # not a preflight we answer: the key is required
    for kind in ("get", "stream"):
        assert on[kind, ok][0] == 200 and on[kind, ok][1]["Access-Control-Allow-Origin"] == ok
        assert on[kind, ok][1]["Vary"] == "Origin"
        assert "Access-Control-Allow-Origin" not in on[kind, evil][1]
    for _, headers in on.values():
        assert headers.get("Access-Control-Allow-Origin") != "*"
        assert "Access-Control-Allow-Credentials" not in headers
    with pytest.raises(ValueError):
        asyncio.run(go(allowed_origin=("*",)))


def test_log_injection_is_escaped(engine, caplog):
    caplog.set_level(logging.DEBUG)

    async def go():
        async with serving(engine) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "x\r\nFORGED line", "messages": CHAT}
            )
            assert r.status == 404
            assert (await r.json())["error"][
                "message"
            ] == "The model 'x\\r\\nFORGED line' does not exist."
            status, _, _ = await raw(
                client,
                "POST /v1/chat/completions%0d%0aFORGED HTTP/1.1\n"
                "Host: x\nContent-Length: 0\nConnection: close\n",
            )
            assert status == 404
            r = await client.post("/v1/completions", json={"prompt": "\r\nFORGED", "n": 0})
            assert r.status == 400

    asyncio.run(go())
    for record in caplog.records:
        message = record.getMessage()
        assert "\n" not in message and "\r" not in message, message
    assert not any(line.startswith("FORGED") for line in caplog.text.splitlines())


def test_no_unsafe_deserialization_in_the_package():
    root = pathlib.Path(__file__).resolve().parents[1]
    pattern = re.compile(
        r"\bimport pickle\b|\bpickle\.|\btorch\.load\(|(?<![\w.])eval\(|(?<![\w.])exec\("
        r"|\byaml\.load\(|\bmarshal\.loads\("
    )
    hits = [
        f"{path.relative_to(root)}:{i}"
        for folder in ("tinyserve", "kernels")
        for path in sorted((root / folder).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
