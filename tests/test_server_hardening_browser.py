"""Hardening, browser-facing safety: JSON-only POST bodies (no preflight-free cross-site
request), a Host allow-list (DNS rebinding), a header timeout (slowloris), 100-continue only after
auth, and the `tinyserve run` flags that set them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import click
import hardening_helpers
import pytest
from hardening_helpers import (
    CHAT_URL,
    COMPLETIONS_URL,
    GOOD,
    KEY,
    body_of,
    check_error,
    connect,
    exchange,
    post_raw,
    read_response,
    request_bytes,
)
from test_server import CHAT, oai, serving

from tinyserve import cli
from tinyserve.serve.server import ServerConfig

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
quiet_log = hardening_helpers.quiet_log  # the fixture, bound here so that pytest finds it


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


# -- 2a. POST bodies are JSON: no simple (preflight-free) cross-site request ----------------------


def test_post_bodies_must_be_json(engine, quiet_log):
    async def go():
        async with serving(engine) as client:
            for url in GOOD:
                data = body_of(url)
                for ctype in (
                    None,
                    "text/plain",
                    "text/plain; charset=utf-8",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "application/json; charset=latin-1",
                    "application/json-patch+json",
                    "application/jsonx",
                    "",
                ):
                    headers = {} if ctype is None else {"Content-Type": ctype}
                    status, content_type, text = await post_raw(client, url, data, headers)
                    check_error(status, content_type, text, 415, code="unsupported_media")
                for ctype in (
                    "application/json",
                    "application/json; charset=utf-8",
                    "application/json;charset=UTF-8",
                    "Application/JSON",
                ):
                    status, _, text = await post_raw(client, url, data, {"Content-Type": ctype})
                    assert status == 200, (url, ctype, text)
            # the official client and curl with the README's header still work
            c = oai(client)
            chat = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
            assert chat.choices[0].finish_reason == "length"
            comp = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
            assert comp.choices[0].finish_reason == "length"
            url = str(client.make_url(CHAT_URL))
            for args, want in (
                (["-H", "Content-Type: application/json"], 200),
                ([], 415),  # curl -d alone sends application/x-www-form-urlencoded
            ):
                out = await asyncio.to_thread(
                    subprocess.run,
                    [
                        "curl",
                        "-s",
                        "-w",
                        "\n%{http_code}",
                        url,
                        *args,
                        "-d",
                        body_of(CHAT_URL).decode(),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                text, _, code = out.stdout.rpartition("\n")
                assert int(code) == want, out.stdout
                assert json.loads(text)

    asyncio.run(go())


# -- 2b. the Host header names this server (DNS rebinding) --------------------------------------


def test_host_allow_list(engine, quiet_log):
    local = [
        b"localhost",
        b"localhost:8000",
        b"LocalHost.",
        b"127.0.0.1",
        b"127.0.0.1:8000",
        b"[::1]",
        b"[::1]:8000",
        b"app.localhost:8000",
        b"10.1.2.3:8000",  # an address literal cannot be rebound
        b"[fe80::1]",
    ]
    foreign = [
        b"evil.example",
        b"evil.example:8000",
        b"localhost.evil.example",
        b"127.0.0.1.nip.io",
    ]

    async def statuses(hosts, paths=("/v1/models", CHAT_URL), **config):
        out = {}
        async with serving(engine, **config) as client:
            for host in hosts:
                for path in paths:
                    method = "POST" if path in GOOD else "GET"
                    body = body_of(path) if method == "POST" else b""
                    extra = {"Content_Type": "application/json"} if body else {}
                    data = request_bytes(method, path, body, host=host, **extra)
                    status, headers, text = await exchange(client, data)
                    if status == 400:
                        err = check_error(status, headers["content-type"], text.decode(), 400)
                        assert err["code"] == "invalid_host" and "--allowed-host" in err["message"]
                    out[host, path] = status
        return out

    def run(*args, **kw):
        return asyncio.run(statuses(*args, **kw))

    assert set(run(local).values()) == {200}
    assert set(run(foreign).values()) == {400}
    # /health answers probes by any name; unknown paths stay 404s
    health = run(foreign, paths=("/health", "/nothing"))
    assert {k[1]: v for k, v in health.items()} == {"/health": 200, "/nothing": 404}
    allowed = run(
        foreign + [b"api.example.org", b"x.api.example.org", b"example.org"],
        allowed_host=("evil.example", ".api.example.org"),
    )
    assert {k[0]: v for k, v in allowed.items()} == {
        b"evil.example": 200,
        b"evil.example:8000": 200,
        b"localhost.evil.example": 400,
        b"127.0.0.1.nip.io": 400,
        b"api.example.org": 200,
        b"x.api.example.org": 200,
        b"example.org": 400,
    }
    assert set(run(foreign, allowed_host=("*",)).values()) == {200}
    assert set(run([b"my-box.lan:8000"], host="my-box.lan").values()) == {200}  # the bound name
    # HTTP/1.0 without a Host header is no browser
    no_host = run([None], paths=("/v1/models",))
    assert set(no_host.values()) == {200}


# -- 2c. slowloris: headers must arrive within --header-timeout ----------------------------------


def test_slow_headers_are_cut(engine, quiet_log):
    async def go():
        async with serving(engine, header_timeout=0.5) as client:
            loop = asyncio.get_running_loop()
            async with connect(client) as (reader, writer):
                t0 = loop.time()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: local")
                await writer.drain()
                closed_at = None
                for _ in range(40):  # one more header byte every 0.1 s: never complete
                    try:
                        writer.write(b"h")
                        await writer.drain()
                        data = await asyncio.wait_for(reader.read(100), 0.1)
                    except asyncio.TimeoutError:
                        continue
                    except ConnectionError:
                        data = b""
                    assert data == b"", data
                    closed_at = loop.time() - t0
                    break
                assert closed_at is not None and 0.4 <= closed_at < 2.0, closed_at
            # an idle connection is closed too, a complete request is served, and a response
            # that takes longer than the header timeout is not cut
            async with connect(client) as (reader, writer):
                await asyncio.sleep(1.0)
                assert await asyncio.wait_for(reader.read(100), 1.0) == b""
            body = json.dumps(
                {"prompt": "Hi", "max_tokens": 64, "ignore_eos": True, "stream": True}
            ).encode()
            t0 = loop.time()
            data = request_bytes("POST", COMPLETIONS_URL, body, Content_Type="application/json")
            async with connect(client) as (reader, writer):
                writer.write(data)
                await writer.drain()
                raw = await asyncio.wait_for(reader.read(), 30)
            assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(
                b"data: [DONE]\n\n\r\n0\r\n\r\n"
            )
            assert loop.time() - t0 > 0.5  # else the test proves nothing: make it longer

    asyncio.run(go())


# -- 2d. Expect: 100-continue only after auth ---------------------------------------------------


def test_expect_100_continue_after_auth(engine, quiet_log):
    body = body_of(COMPLETIONS_URL)
    auth = f"Bearer {KEY}"

    async def refused(
        client, *, path=COMPLETIONS_URL, host=b"localhost", size=None, **headers
    ) -> int:
        """The first answer to a request that expects 100-continue (its body is never sent)."""
        size = len(body) if size is None else size
        data = request_bytes("POST", path, host=host, Expect="100-continue", **headers)
        async with connect(client) as (reader, writer):
            writer.write(data.replace(b"Content-Length: 0", f"Content-Length: {size}".encode()))
            await writer.drain()
            status, headers, text = await read_response(reader)
            assert status != 100
            check_error(status, headers["content-type"], text.decode(), status)
            return status

    async def go():
        async with serving(engine, api_key=KEY, max_body_bytes=4096) as client:
            assert await refused(client, Content_Type="application/json") == 401
            for path in ("/nothing", "/v1/models", "/health"):  # no route, GET-only routes
                assert await refused(client, path=path, Content_Type="application/json") == 401
            for path, want in (("/nothing", 404), ("/v1/models", 405)):
                status = await refused(
                    client, path=path, Content_Type="application/json", Authorization=auth
                )
                assert status == want
            assert (
                await refused(client, Content_Type="application/json", Authorization="Bearer x")
                == 401
            )
            assert await refused(client, Content_Type="text/plain", Authorization=auth) == 415
            assert (
                await refused(
                    client, Content_Type="application/json", Authorization=auth, size=10**6
                )
                == 413
            )
            assert (
                await refused(
                    client,
                    host=b"evil.example",
                    Content_Type="application/json",
                    Authorization=auth,
                )
                == 400
            )
            # an unknown expectation: 417, OpenAI-shaped
            data = request_bytes(
                "POST", COMPLETIONS_URL, body, Expect="x-magic", Authorization=auth
            )
            status, headers, text = await exchange(client, data)
            check_error(status, headers["content-type"], text.decode(), 417)
            # with the key: 100 Continue, then the body, then the answer
            data = request_bytes(
                "POST",
                COMPLETIONS_URL,
                Expect="100-continue",
                Content_Type="application/json",
                Authorization=auth,
            ).replace(b"Content-Length: 0", f"Content-Length: {len(body)}".encode())
            async with connect(client) as (reader, writer):
                writer.write(data)
                await writer.drain()
                line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert line == b"HTTP/1.1 100 Continue\r\n\r\n"
                writer.write(body)
                await writer.drain()
                status, _, text = await read_response(reader, timeout=30)
                assert status == 200, text

    asyncio.run(go())


# -- flags ----------------------------------------------------------------------------------------


def test_run_flags_map_onto_server_config():
    from dataclasses import fields

    # Every flag configures the engine or the server, but --debug-log (the process's logging).
    names = {p.name for p in cli.run.params} - set(cli.ENGINE_KEYS) - {"debug_log"}
    assert names == {f.name for f in fields(ServerConfig)}
    text = cli.run.get_help(click.Context(cli.run))
    for flag in ("--allowed-host", "--header-timeout"):
        assert flag in text
    config = ServerConfig(allowed_host=["A.example", ".b.example"], header_timeout=3)
    assert config.allowed_host == ("a.example", ".b.example") and config.header_timeout == 3
    for bad in ({"header_timeout": 0}, {"header_timeout": -1}, {"allowed_host": ("",)}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
