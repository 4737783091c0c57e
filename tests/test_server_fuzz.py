"""Fuzz: 500 seeded, mutated bodies per POST route (200 on the Responses and Messages APIs'
routes). Never a 5xx, always the route's error shape on a 4xx (Anthropic's on /v1/messages, else
OpenAI's), complete SSE streams on a 200, and the engine's invariants afterwards.

Mutated bodies start valid and take 1-3 random mutations (edge-case values for known fields,
dropped and unknown keys, wrong shapes, raw broken JSON). max_tokens is clamped small and the model
is a tiny random one with SmolLM2's tokenizer, so generation is quick. The hypothesis pass over
every route's schema is in test_server_fuzz_schemas.py.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from fuzz_helpers import BASE, KEYS, NEW_APIS, RAW, check, make_tiny_llm, value
from test_server import serving, wait_idle

pytestmark = pytest.mark.slow

NUM_BODIES, BATCH = 500, 50
NUM_NEW_API_BODIES = 200  # /v1/responses and /v1/messages: their own schemas, then the same path


@pytest.fixture(scope="module")
def tiny_llm(smollm2_path, tmp_path_factory):
    return make_tiny_llm(smollm2_path, tmp_path_factory)


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
        for k in ("max_tokens", "max_output_tokens"):
            if body.get(k) is None:  # null or absent: up to the context limit
                body[k] = 2
        for k in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(k), int) and 4 < body[k] < 10**6:
                body[k] = 4
    return body


@pytest.mark.parametrize("url", list(BASE))
def test_fuzz_route(tiny_llm, url):
    engine = tiny_llm.engine
    rng = random.Random(list(BASE).index(url))
    num_bodies = NUM_NEW_API_BODIES if url in NEW_APIS else NUM_BODIES
    bodies = [mutate(rng, json.loads(json.dumps(BASE[url]))) for _ in range(num_bodies)]

    async def go():
        statuses = []
        async with serving(engine) as client:
            for i in range(0, num_bodies, BATCH):
                batch = bodies[i : i + BATCH]
                statuses += await asyncio.gather(*(check(client, url, b) for b in batch))
                await wait_idle(engine)
                engine.check_invariants()
                assert engine.pool.num_free_blocks == engine.pool.num_blocks
        return statuses

    statuses = asyncio.run(go())
    assert len(statuses) == num_bodies
    # the mutations must exercise both paths
    assert statuses.count(200) >= 25 and sum(s >= 400 for s in statuses) >= num_bodies // 5
