"""Hardening, client input: every client-controlled input (body bytes, numbers, encodings,
framing, header bytes) gets an OpenAI-shaped 4xx and no traceback in the log. Framing and header
tricks go over a raw socket (hardening_helpers) so that nothing normalizes them.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import hardening_helpers
import pytest
from hardening_helpers import (
    CHAT_URL,
    COMPLETIONS_URL,
    GOOD,
    JSON,
    KEY,
    body_of,
    check_error,
    connect,
    exchange,
    post_raw,
    read_response,
    request_bytes,
)
from test_server import serving

pytestmark = pytest.mark.slow

HUGE = 10**400  # an integer no float can hold
quiet_log = hardening_helpers.quiet_log  # the fixture, bound here so that pytest finds it


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


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
