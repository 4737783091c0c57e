"""Fuzz: 500 seeded, mutated bodies per POST route. Never a 5xx, always the OpenAI error shape on
a 4xx, complete SSE streams on a 200, and the engine's invariants after every batch of 50.

Bodies start valid and take 1-3 random mutations (edge-case values for known fields, dropped and
unknown keys, wrong shapes, raw broken JSON). max_tokens is clamped small so generation is quick.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from test_server import serving, wait_idle

pytestmark = pytest.mark.slow

NUM_BODIES, BATCH = 500, 50
MODEL = "SmolLM2-135M-Instruct"
MSG = {"role": "user", "content": "Hi"}
BASE = {
    "/v1/chat/completions": {"model": MODEL, "messages": [MSG], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
KEYS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "tools",
    "tool_choice",
    "response_format",
    "echo",
    "suffix",
    "best_of",
    "user",
    "tokens",
    "add_special_tokens",
]
INTS = [0, 1, -1, 2, 3, 4, 5, 16, 17, 20, 21, 300, 49151, 49152, 2**31, 2**63, -(2**63) - 1, 10**30]
FLOATS = [
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    2.5,
    -0.5,
    1e-9,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
]
STRINGS = [
    "",
    "a",
    "Hi",
    "x" * 300,
    "é中🙂",
    "\x00",
    "\r\nFORGED",
    MODEL,
    "user",
    "system",
    "assistant",
    "text",
    "<|im_end|>",
    "{{ raise_exception('x') }}",
]
RAW = [
    b'{"model":',
    b"",
    b"null",
    b"\xff\xfe\x00",
    b"[" * 5000,
    b'{"n": NaN}',
    b'{"max_tokens": 1e999}',
    b'{"a": 1' + b"2" * 5000 + b"}",
    b"{'single': 1}",
    b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,}',
]


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(INTS)
    if kind == 3:
        return rng.choice(FLOATS)
    if kind == 4:
        return rng.choice(STRINGS)
    if kind == 5:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {
            rng.choice(KEYS + ["role", "content", "type", "text", "1"]): value(rng, depth + 1)
            for _ in range(rng.randrange(4))
        }
    if kind == 7:
        return [
            rng.choice(
                [
                    MSG,
                    {"role": value(rng, 2), "content": value(rng, 2)},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                ]
            )
            for _ in range(rng.randrange(1, 3))
        ]
    return [rng.choice(INTS[:9]) for _ in range(rng.randrange(1, 6))]  # token ids


def mutate(rng: random.Random, body: dict):
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(10)
        if op < 5:
            body[rng.choice(KEYS)] = value(rng)
        elif op < 7 and body:
            body.pop(rng.choice(list(body)))
        elif op == 7:
            body[f"unknown_{rng.randrange(100)}"] = value(rng)
        elif op == 8:
            body = value(rng)  # the whole body is some other JSON value
            break
        else:
            return rng.choice(RAW)
    if isinstance(body, dict):  # keep generation short: never up to the context limit
        if body.get("max_tokens") is None:  # null or absent: up to the context limit
            body["max_tokens"] = 2
        for k in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(k), int) and 4 < body[k] < 10**6:
                body[k] = 4
    return body


def encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def check(client, url: str, body) -> int:
    r = await client.post(url, data=encode(body), headers={"Content-Type": "application/json"})
    text = await r.text()
    assert r.status < 500, (url, body, text)
    if r.status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, text
        assert "Traceback" not in text and ".py" not in text
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text[-200:]
        assert '"error"' not in text, text
    else:
        json.loads(text)
    return r.status


@pytest.mark.parametrize("url", list(BASE))
def test_fuzz_route(smollm2_llm, url):
    engine = smollm2_llm.engine
    rng = random.Random(list(BASE).index(url))
    bodies = [mutate(rng, json.loads(json.dumps(BASE[url]))) for _ in range(NUM_BODIES)]

    async def go():
        statuses = []
        async with serving(engine) as client:
            for i in range(0, NUM_BODIES, BATCH):
                batch = bodies[i : i + BATCH]
                statuses += await asyncio.gather(*(check(client, url, b) for b in batch))
                await wait_idle(engine)
                engine.check_invariants()
                assert engine.pool.num_free_blocks == engine.pool.num_blocks
        return statuses

    statuses = asyncio.run(go())
    assert len(statuses) == NUM_BODIES
    # the mutations must exercise both paths
    assert statuses.count(200) >= 25 and sum(s >= 400 for s in statuses) >= 100, statuses
