"""What the hardening tests (test_server_hardening*.py) share: the URLs with a good body for each,
the OpenAI error-shape check, the `quiet_log` fixture, and raw-socket helpers: framing and header
tricks go over a raw socket so that nothing normalizes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging

import pytest
from test_server import CHAT

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
KEY = "sekret-key-123"
GOOD = {
    CHAT_URL: {"messages": CHAT, "max_tokens": 1},
    COMPLETIONS_URL: {"prompt": "Hi", "max_tokens": 1},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def quiet_log(caplog):
    """Fails the test if anything logged a traceback or an ERROR (a client mistake is neither)."""
    # An earlier test's unclosed openai client, finalized while this test's loop runs, logs
    # "Task exception was never retrieved" (its aclose() on a closed loop): collect it first.
    gc.collect()
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
