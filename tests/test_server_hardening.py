"""Hardening: every client-controlled input gets an OpenAI-shaped 4xx and no traceback in the log;
browser-facing safety (JSON-only POST bodies, a Host allow-list, a header timeout, 100-continue
only after auth). Framing and header tricks go over a raw socket so that nothing normalizes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import subprocess
import zlib

import click
import pytest
from test_server import CHAT, oai, serving

from tinyserve import cli
from tinyserve.serve.server import ServerConfig

pytestmark = pytest.mark.slow

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
KEY = "sekret-key-123"
MODEL = "SmolLM2-135M-Instruct"
HUGE = 10**400  # an integer no float can hold
GOOD = {
    CHAT_URL: {"messages": CHAT, "max_tokens": 1},
    COMPLETIONS_URL: {"prompt": "Hi", "max_tokens": 1},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


@pytest.fixture
def quiet_log(caplog):
    """Fails the test if anything logged a traceback or an ERROR (a client mistake is neither)."""
    caplog.set_level(logging.DEBUG)
    yield
    records = caplog.get_records("call")  # (caplog.records here: the teardown's only)
    assert records, "nothing was logged: is the log captured?"
    loud = [r for r in records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [(r.name, r.getMessage()) for r in loud]


def check_error(status: int, content_type: str, text: str, want: int, param="any", code="any"):
    """The OpenAI error shape with the expected status (and param / code when given)."""
    assert status == want, (status, text)
    assert content_type.startswith("application/json"), (content_type, text)
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in text and ".py" not in text
    if param != "any":
        assert body["error"]["param"] == param, body
    if code != "any":
        assert body["error"]["code"] == code, body
    return body["error"]


async def post_raw(client, url: str, data: bytes, headers: dict[str, str] | None = None):
    """POST bytes with exactly these headers (aiohttp adds no Content-Type of its own)."""
    r = await client.post(
        url, data=data, headers=headers or {}, skip_auto_headers=("Content-Type",)
    )
    return r.status, r.content_type, await r.text()


# -- raw sockets ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def connect(client):
    reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_response(reader, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-case names) and a Content-Length body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    size = int(headers.get("content-length", 0))
    body = await asyncio.wait_for(reader.readexactly(size), timeout) if size else b""
    return int(lines[0].split()[1]), headers, body


async def exchange(client, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    async with connect(client) as (reader, writer):
        writer.write(data)
        await writer.drain()
        return await read_response(reader, timeout)


def request_bytes(
    method: str, path: str, body: bytes = b"", host: bytes | None = b"localhost", **headers: str
) -> bytes:
    version = "1.1" if host is not None else "1.0"  # HTTP/1.0 may omit Host
    lines = [f"{method} {path} HTTP/{version}".encode()]
    if host is not None:
        lines.append(b"Host: " + host)
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}".encode())
    for name, value in headers.items():
        lines.append(f"{name.replace('_', '-')}: {value}".encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def body_of(url: str) -> bytes:
    return json.dumps(GOOD[url]).encode()


# -- 1. client input is never a 500 -------------------------------------------------------------


def test_lone_surrogates_are_a_400(engine, quiet_log):
    lone = [
        (CHAT_URL, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
        (
            CHAT_URL,
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
            "messages",
        ),
        (
            CHAT_URL,
            b'{"messages": [{"role": "user", "content": "x", "name": "\\uDC00"}]}',
            "messages",
        ),
        (COMPLETIONS_URL, b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt"),
        (COMPLETIONS_URL, b'{"prompt": ["ok", "\\ud800"], "max_tokens": 1}', "prompt"),
        (COMPLETIONS_URL, b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
        (
            COMPLETIONS_URL,
            b'{"prompt": "x", "cache_salt": "\\ud800", "max_tokens": 1}',
            "cache_salt",
        ),
        (COMPLETIONS_URL, b'{"prompt": "x", "\\ud800": 1, "max_tokens": 1}', None),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
        ("/detokenize", b'{"tokens": [1], "x": "\\ud800"}', "x"),
    ]

    async def go():
        async with serving(engine) as client:
            for url, data, param in lone:
                check_error(*await post_raw(client, url, data, JSON), 400, param, "invalid_unicode")
            # an escaped pair is one valid character; an escaped backslash is no escape
            for text in (b'"\\ud83d\\ude00"', b'"\\\\ud800"'):
                status, _, out = await post_raw(
                    client, "/tokenize", b'{"prompt": ' + text + b"}", JSON
                )
                assert status == 200, out

    asyncio.run(go())


REAL_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
INT_FIELDS = ["n", "top_k", "seed", "min_tokens", "max_tokens", "best_of", "logprobs"]


def test_huge_and_non_finite_numbers_are_a_400(engine, quiet_log):
    cases = []
    for url in (CHAT_URL, COMPLETIONS_URL):
        for field in REAL_FIELDS:
            for value in (HUGE, -HUGE):
                cases.append((url, {**GOOD[url], field: value}, field))
        cases.append((url, {**GOOD[url], "logit_bias": {"1": HUGE}}, "logit_bias"))
        cases.append((url, {**GOOD[url], "logit_bias": {"1": -HUGE}}, "logit_bias"))
        cases.append((url, {**GOOD[url], "stop_token_ids": [HUGE]}, "stop_token_ids"))
    cases += [
        (CHAT_URL, {**GOOD[CHAT_URL], "logprobs": True, "top_logprobs": HUGE}, "top_logprobs"),
        (CHAT_URL, {**GOOD[CHAT_URL], "max_completion_tokens": HUGE}, "max_completion_tokens"),
        (COMPLETIONS_URL, {"prompt": [HUGE], "max_tokens": 1}, "prompt"),
        (COMPLETIONS_URL, {"prompt": [[1, -HUGE]], "max_tokens": 1}, "prompt"),
        ("/detokenize", {"tokens": [HUGE]}, "tokens"),
    ]
    loose = [  # valid or not, never a 500 (top_k past the vocabulary is off, a seed wraps)
        (url, {**GOOD[url], field: value})
        for url in (CHAT_URL, COMPLETIONS_URL)
        for field in INT_FIELDS
        for value in (HUGE, -HUGE)
    ]
    literals = [  # NaN / Infinity literals and overflowing exponents (json.loads reads them)
        (COMPLETIONS_URL, b'{"prompt": "x", "max_tokens": 1, "%s": %s}' % (f.encode(), lit), f)
        for f in REAL_FIELDS
        for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999")
    ] + [
        (COMPLETIONS_URL, b'{"prompt": "x", "logit_bias": {"1": %s}}' % lit, "logit_bias")
        for lit in (b"NaN", b"Infinity", b"1e999")
    ]

    async def go():
        async with serving(engine) as client:
            for url, body, param in cases:
                data = json.dumps(body).encode()
                check_error(*await post_raw(client, url, data, JSON), 400, param)
            for url, data, param in literals:
                check_error(*await post_raw(client, url, data, JSON), 400, param)
            for url, body in loose:
                status, _, text = await post_raw(client, url, json.dumps(body).encode(), JSON)
                assert status in (200, 400, 404), (url, body, status, text)

    asyncio.run(go())


def test_content_encoding(engine, quiet_log):
    good = body_of(COMPLETIONS_URL)

    async def go():
        async with serving(engine, max_body_bytes=4096) as client:
            for encoding, data, want, code in [
                ("gzip", b"garbage", 400, "invalid_content_encoding"),
                ("gzip", gzip.compress(good)[:-6], 400, "invalid_content_encoding"),
                ("gzip", gzip.compress(good) + b"trailing", 400, "invalid_content_encoding"),
                ("deflate", b"\x78garbage", 400, "invalid_content_encoding"),
                ("gzip", gzip.compress(b" " * 100_000), 413, "request_too_large"),  # a bomb
                ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
                ("zstd", b"(\xb5/\xfd", 415, "unsupported_content_encoding"),
                ("compress", good, 415, "unsupported_content_encoding"),
                ("gzip, br", good, 415, "unsupported_content_encoding"),
            ]:
                headers = {**JSON, "Content-Encoding": encoding}
                status, ctype, text = await post_raw(client, COMPLETIONS_URL, data, headers)
                check_error(status, ctype, text, want, code=code)
            raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
            for encoding, data in [
                ("gzip", gzip.compress(good)),
                ("GZIP", gzip.compress(good)),
                ("x-gzip", gzip.compress(good)),
                ("deflate", zlib.compress(good)),
                ("deflate", raw_deflate.compress(good) + raw_deflate.flush()),
                ("identity", good),
            ]:
                headers = {**JSON, "Content-Encoding": encoding}
                status, _, text = await post_raw(client, COMPLETIONS_URL, data, headers)
                assert status == 200, (encoding, text)

    asyncio.run(go())


def test_other_client_mistakes_are_4xx_without_a_traceback(engine, quiet_log):
    bad = [
        (CHAT_URL, b"\xff\xfe{}", 400),  # not UTF-8
        (CHAT_URL, '{"messages": "é"}'.encode("utf-16"), 400),  # JSON must be UTF-8
        (CHAT_URL, b"\xef\xbb\xbf{}", 400),  # a BOM is no JSON
        (CHAT_URL, b"[" * 2_000_000, 413),  # past max_body_bytes
        (CHAT_URL, b"[" * 50_000 + b"]" * 50_000, 400),  # nesting past the recursion limit
        (CHAT_URL, b"1" * 5000, 400),  # past Python's int digit limit
        (CHAT_URL, b"", 400),
        (CHAT_URL, b"null", 400),
        (CHAT_URL, b"3", 400),
        (CHAT_URL, b'"messages"', 400),
        (CHAT_URL, b'{"messages": {"role": "user", "content": "x"}}', 400),
        (CHAT_URL, b'{"messages": [["user", "x"]]}', 400),
        (CHAT_URL, b'{"messages": [{"role": {"a": 1}, "content": "x"}]}', 400),
        (CHAT_URL, b'{"messages": [{"role": ["user"], "content": "x"}]}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": 5}]}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": [[{"type": "text"}]]}]}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": [{"type": {"x": 1}}]}]}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": {}}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}', 400),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 1}', 400),
        (
            CHAT_URL,
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": [1]}',
            400,
        ),
        (CHAT_URL, b'{"messages": [{"role": "user", "content": "x"}], "n": NaN}', 400),
        (COMPLETIONS_URL, b'{"prompt": {"a": 1}}', 400),
        (COMPLETIONS_URL, b'{"prompt": [[1, [2]]]}', 400),
        (COMPLETIONS_URL, b'{"prompt": [NaN]}', 400),
        (COMPLETIONS_URL, b'{"prompt": "x", "logit_bias": {"1": [1]}}', 400),
        (COMPLETIONS_URL, b'{"prompt": "x", "best_of": {"a": 1}}', 400),
        (COMPLETIONS_URL, b'{"prompt": "x", "echo": [1]}', 400),
        (COMPLETIONS_URL, b'{"prompt": ' + json.dumps(list(range(100_000))).encode() + b"}", 400),
        ("/detokenize", b'{"tokens": ' + json.dumps([5] * 200_000).encode() + b"}", 400),
        ("/detokenize", b'{"tokens": {"a": 1}}', 400),
        ("/detokenize", b"[]", 400),
        ("/tokenize", b'{"messages": 5}', 400),
        ("/tokenize", b'{"prompt": "x", "add_special_tokens": "yes"}', 400),
    ]

    async def go():
        async with serving(engine, max_body_bytes=1 << 20) as client:
            for url, data, want in bad:
                check_error(*await post_raw(client, url, data, JSON), want)
            # duplicate keys: the last one wins (as in every mainstream JSON parser)
            data = b'{"prompt": 5, "prompt": "Hi", "max_tokens": 1}'
            status, _, text = await post_raw(client, COMPLETIONS_URL, data, JSON)
            assert status == 200, text
            # broken chunked framing and a body cut short are the client's mistake too
            head = request_bytes("POST", COMPLETIONS_URL, Content_Type="application/json")
            chunked = head.replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
            async with connect(client) as (reader, writer):
                writer.write(chunked + b"zz\r\n{}\r\n0\r\n\r\n")
                await writer.drain()
                status, _, _ = await read_response(reader)
                assert 400 <= status < 500
            cut = request_bytes("POST", COMPLETIONS_URL, b"x" * 10, Content_Type="application/json")
            async with connect(client) as (reader, writer):
                writer.write(cut.replace(b"Content-Length: 10", b"Content-Length: 100"))
                await writer.drain()
                writer.close()
            await asyncio.sleep(0.2)
            r = await client.post(COMPLETIONS_URL, json=GOOD[COMPLETIONS_URL])
            assert r.status == 200

    asyncio.run(go())


def test_odd_header_bytes_are_4xx(engine, quiet_log):
    async def go():
        async with serving(engine, api_key=KEY) as client:
            for header in (
                b"Authorization: Bearer \xff\xfe",
                b"Authorization: Bearer " + KEY.encode() + b"\xc3\xa9",
                b"Authorization: \xe9",
            ):
                data = request_bytes("GET", "/v1/models").replace(
                    b"Connection", header + b"\r\nConnection"
                )
                status, headers, text = await exchange(client, data)
                check_error(status, headers["content-type"], text.decode(), 401)
            auth = f"Bearer {KEY}"
            for host in (b"\xff\xfe", b"evil.example:80\xe9", b"[::1", b"a:b:c", b""):
                data = request_bytes("GET", "/v1/models", host=host, Authorization=auth)
                status, headers, text = await exchange(client, data)
                assert 400 <= status < 500, (host, status)
            # malformed HTTP is aiohttp's to answer (plain text); it logs one line, no traceback
            for data in (
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Long: " + b"v" * 16384 + b"\r\n\r\n",
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n",
                b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS to plain HTTP
            ):
                status, _, _ = await exchange(client, data)
                assert 400 <= status < 500, (data[:40], status)
            for ctype in ("\u00e9", "application/json; charset=\u00e9", ";;;=", "*/*"):
                data = request_bytes(
                    "POST", "/tokenize", b'{"prompt": "x"}', Authorization=auth
                ).replace(b"Connection", b"Content-Type: " + ctype.encode() + b"\r\nConnection")
                status, headers, text = await exchange(client, data)
                check_error(status, headers["content-type"], text.decode(), 415)

    asyncio.run(go())


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

    names = {p.name for p in cli.run.params} - set(cli.ENGINE_KEYS)
    assert names == {f.name for f in fields(ServerConfig)}
    text = cli.run.get_help(click.Context(cli.run))
    for flag in ("--allowed-host", "--header-timeout"):
        assert flag in text
    config = ServerConfig(allowed_host=["A.example", ".b.example"], header_timeout=3)
    assert config.allowed_host == ("a.example", ".b.example") and config.header_timeout == 3
    for bad in ({"header_timeout": 0}, {"header_timeout": -1}, {"allowed_host": ("",)}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)
