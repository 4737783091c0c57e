"""Bad input gets an OpenAI-shaped 4xx and the server keeps serving (checklist items 1-13).

Each test runs a batch of bad requests against one app, then a good one; `serving` checks on exit
that nothing reached the KV pool (every block free, invariants hold).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from test_server import CHAT, serving

pytestmark = pytest.mark.slow

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


async def expect_error(resp, status: int, param="any", code="any") -> dict:
    """The OpenAI error shape, no traceback or path; returns the error object."""
    text = await resp.text()
    assert resp.status == status, text
    assert resp.content_type == "application/json"
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in text and ".py" not in text and "/work" not in text
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


async def post(client, url: str, body) -> object:
    return await client.post(url, json=body)


def chat(**kw) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **kw}


async def still_serves(client) -> None:
    r = await client.post(CHAT_URL, json=chat())
    assert r.status == 200, await r.text()
    assert (await r.json())["usage"]["completion_tokens"] >= 1


def run_cases(engine, cases, **config) -> None:
    """cases: (url, body or raw bytes, status, param, code)."""

    async def go():
        async with serving(engine, **config) as client:
            for url, body, status, param, code in cases:
                if isinstance(body, bytes):
                    r = await client.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    )
                else:
                    r = await client.post(url, json=body)
                await expect_error(r, status, param, code)
            await still_serves(client)

    asyncio.run(go())


def test_1_malformed_json_2_wrong_types_3_content_type(engine):
    cases = [
        (CHAT_URL, b'{"model":', 400, None, "invalid_json"),
        (CHAT_URL, b"\xff\xfe{", 400, None, "invalid_json"),
        (CHAT_URL, b"[" * 100_000, 400, None, "invalid_json"),  # deep nesting
        (CHAT_URL, b'{"n": 1' + b"1" * 5000 + b"}", 400, None, "invalid_json"),  # 5000 digits
        (CHAT_URL, [], 400, None, None),
        (CHAT_URL, "x", 400, None, None),
        (CHAT_URL, {"messages": "hello"}, 400, "messages", None),
        (CHAT_URL, chat(max_tokens="10"), 400, "max_tokens", None),
        (CHAT_URL, chat(max_completion_tokens=1.5), 400, "max_completion_tokens", None),
        (CHAT_URL, chat(temperature=None), 400, "temperature", None),
        (CHAT_URL, chat(stream="yes"), 400, "stream", None),
        (CHAT_URL, chat(stream_options={"include_usage": True}), 400, "stream_options", None),
        (CHAT_URL, chat(logprobs=1), 400, "logprobs", None),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages",
            None,
        ),
        (CHAT_URL, chat(tools=[{"type": "function"}]), 400, "tools", None),
        (COMPLETIONS_URL, {"prompt": 5}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": [1, "a"]}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": [True]}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": [10**9]}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": ["a"] * 17}, 400, "prompt", None),
        ("/tokenize", {"prompt": 3}, 400, "prompt", None),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    ]
    run_cases(engine, cases)

    async def content_type():
        async with serving(engine) as client:
            r = await client.post(
                CHAT_URL,
                data="messages=hi",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            )
            await expect_error(r, 415)
            await expect_error(await client.get(CHAT_URL), 405, code="method_not_allowed")
            await expect_error(await client.get("/v2/nothing"), 404, code="not_found")
            await still_serves(client)

    asyncio.run(content_type())


def test_4_empty_input_5_unknown_model(engine):
    cases = [
        (CHAT_URL, {"messages": []}, 400, "messages", None),
        (CHAT_URL, {"messages": [{"role": "user", "content": ""}]}, 400, "messages", None),
        (CHAT_URL, {"messages": [{"role": "user", "content": []}]}, 400, "messages", None),
        (CHAT_URL, {"messages": [{"role": "user"}]}, 400, "messages", None),
        (COMPLETIONS_URL, {"prompt": ""}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": []}, 400, "prompt", None),
        (COMPLETIONS_URL, {"prompt": [[]]}, 400, "prompt", None),
        (COMPLETIONS_URL, {}, 400, "prompt", None),
        (CHAT_URL, chat(model="nope"), 404, "model", "model_not_found"),
        (COMPLETIONS_URL, {"model": "nope", "prompt": "hi"}, 404, "model", "model_not_found"),
        (CHAT_URL, chat(model=["x"]), 400, "model", None),
    ]
    run_cases(engine, cases)


CONTEXT = re.compile(
    r"This model's maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
    r"\((\d+) in the messages, (\d+) in the completion\)\. Please reduce the length of the "
    r"messages or completion\."
)


def test_6_prompt_at_context_7_prompt_plus_max_tokens(engine):
    limit = engine.max_model_len
    ids = [1000 + i % 5000 for i in range(limit)]

    async def go():
        async with serving(engine) as client:
            free = engine.pool.num_free_blocks
            r = await post(client, COMPLETIONS_URL, {"prompt": ids, "max_tokens": 1})
            err = await expect_error(r, 400, "prompt", "context_length_exceeded")
            assert CONTEXT.fullmatch(err["message"]).groups() == (
                str(limit),
                str(limit + 1),
                str(limit),
                "1",
            )
            assert engine.pool.num_free_blocks == free and not engine.has_unfinished()
            # prompt + max_tokens over the limit: OpenAI's wording, param = max_tokens
            r = await post(
                client, COMPLETIONS_URL, {"prompt": ids[: limit - 100], "max_tokens": 200}
            )
            err = await expect_error(r, 400, "max_tokens", "context_length_exceeded")
            assert CONTEXT.fullmatch(err["message"]).groups() == (
                str(limit),
                str(limit + 100),
                str(limit - 100),
                "200",
            )
            for bad in (0, -1):
                r = await post(client, CHAT_URL, chat(max_tokens=bad))
                await expect_error(r, 400, "max_tokens")
            r = await post(client, CHAT_URL, chat(max_tokens=None, max_completion_tokens=0))
            await expect_error(r, 400, "max_completion_tokens")
            assert engine.pool.num_free_blocks == free
            await still_serves(client)

    asyncio.run(go())


def test_8_sampling_ranges(engine):
    bad = {
        "temperature": [-1, 2.5, float("nan"), 1e309, "0.5", True],
        "top_p": [0, 1.5, -0.1],
        "top_k": [-2, 1.5, "3"],
        "min_p": [-0.5, 2],
        "presence_penalty": [3, -3],
        "frequency_penalty": [3, -3],
        "repetition_penalty": [0, -1],
        "seed": ["a", 1.5],
        "n": [0, -1, 1.5, "2"],
        "min_tokens": [-1, 5],  # 5 > max_tokens = 2
    }
    cases = [
        (
            url,
            chat(**{k: v}) if url == CHAT_URL else {"prompt": "hi", "max_tokens": 2, k: v},
            400,
            k,
            None,
        )
        for k, values in bad.items()
        for v in values
        for url in (CHAT_URL, COMPLETIONS_URL)
    ]
    # json.dumps writes NaN / Infinity, which Python's json.loads accepts: they must still fail
    run_cases(engine, cases)


def test_9_huge_n_and_logprobs_fail_fast(engine):
    cases = [
        (CHAT_URL, chat(n=1_000_000), 400, "n", None),
        (CHAT_URL, chat(n=10**30), 400, "n", None),
        (CHAT_URL, chat(n=0), 400, "n", None),
        (CHAT_URL, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
        (CHAT_URL, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs", None),
        (CHAT_URL, chat(top_logprobs=2), 400, "top_logprobs", None),  # needs logprobs: true
        (COMPLETIONS_URL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
        (COMPLETIONS_URL, {"prompt": "hi", "logprobs": True}, 400, "logprobs", None),
        (COMPLETIONS_URL, {"prompt": "hi", "n": 10**6, "best_of": 10**6}, 400, "n", None),
    ]

    async def go():
        async with serving(engine) as client:
            for url, body, status, param, code in cases:
                t0 = time.perf_counter()
                r = await post(client, url, body)
                await expect_error(r, status, param, code)
                assert time.perf_counter() - t0 < 0.05, body
            await still_serves(client)

    asyncio.run(go())


def test_10_logit_bias_names_every_bad_key(engine):
    vocab = engine.model_config.vocab_size

    async def go():
        async with serving(engine) as client:
            for bias, bad_keys in [
                ({"abc": 1}, ["abc"]),
                ({str(vocab): 1}, [str(vocab)]),
                ({"1": "x"}, ["1"]),
                ({"1": 1e9}, ["1"]),
                ({"-1": 1, "2": 1.0, "x y": 3}, ["-1", "x y"]),
            ]:
                err = await expect_error(
                    await post(client, CHAT_URL, chat(logit_bias=bias)), 400, "logit_bias"
                )
                for key in bad_keys:
                    assert repr(key) in err["message"]
                assert "'2'" not in err["message"]
            too_many = {str(i): 1 for i in range(301)}
            await expect_error(
                await post(client, CHAT_URL, chat(logit_bias=too_many)), 400, "logit_bias"
            )
            await expect_error(
                await post(client, CHAT_URL, chat(logit_bias=[1])), 400, "logit_bias"
            )
            valid = await post(client, CHAT_URL, chat(logit_bias={str(vocab - 1): 1.0}))
            assert valid.status == 200, await valid.text()
            # +100 on one token makes greedy decoding emit nothing else: the bias is applied
            forced = await post(
                client,
                "/v1/completions",
                {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logit_bias": {"1000": 100}},
            )
            ids = engine.tokenizer.encode((await forced.json())["choices"][0]["text"])
            assert ids and set(ids) == {1000}
            r = await post(client, CHAT_URL, chat(logit_bias={}))
            assert r.status == 200
            await still_serves(client)

    asyncio.run(go())


def test_11_stop_lists(engine):
    cases = [
        (CHAT_URL, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
        (CHAT_URL, chat(stop=""), 400, "stop", None),
        (CHAT_URL, chat(stop=[""]), 400, "stop", None),
        (CHAT_URL, chat(stop="x" * 10_000), 400, "stop", None),
        (CHAT_URL, chat(stop=[1]), 400, "stop", None),
        (COMPLETIONS_URL, {"prompt": "a", "stop": {"a": 1}}, 400, "stop", None),
        (CHAT_URL, chat(stop_token_ids=[-1]), 400, "stop_token_ids", None),
        (CHAT_URL, chat(stop_token_ids=[10**9]), 400, "stop_token_ids", None),
    ]
    run_cases(engine, cases)


def test_12_oversized_body_and_headers(engine):
    async def go():
        async with serving(engine) as client:
            big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
            r = await client.post(
                COMPLETIONS_URL, data=big, headers={"Content-Type": "application/json"}
            )
            await expect_error(r, 413, code="request_too_large")
            many = {f"X-Header-{i}": "v" for i in range(200)}
            r = await client.get("/v1/models", headers=many)
            assert r.status in (400, 431)
            r = await client.get("/v1/models", headers={"X-Long": "v" * 16_384})
            assert r.status in (400, 431)
            assert "Traceback" not in await r.text()
            await still_serves(client)

    asyncio.run(go())


def test_13_huge_prompt_rejected_before_tokenizing(engine, monkeypatch):
    calls = []
    encode = engine.tokenizer.encode

    def counting_encode(*args, **kwargs):
        calls.append(args)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", counting_encode)
    text = "hello world " * 75_000  # 900 KB: tokenizing it takes about half a second

    async def go():
        async with serving(engine) as client:
            for url, body, param in [
                (COMPLETIONS_URL, {"prompt": text, "max_tokens": 1}, "prompt"),
                (CHAT_URL, {"messages": [{"role": "user", "content": text}]}, "messages"),
                ("/tokenize", {"prompt": text}, "prompt"),
            ]:
                t0 = time.perf_counter()
                r = await post(client, url, body)
                await expect_error(r, 400, param, "context_length_exceeded")
                assert time.perf_counter() - t0 < 0.2
            assert calls == []
            await still_serves(client)

    asyncio.run(go())
