"""A minute of abuse against a real `tinyserve run`: streams read to the end or dropped midway,
requests cancelled before their first token, long prompts under KV pressure (preemption), n=2,
request deadlines. Afterwards nothing is running or waiting, every KV block is free, and the
resident memory is where it was after the warm-up.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from process_helpers import Server, gauges

from tinyserve.config import CPU_MAX_NUM_BATCHED_TOKENS

pytestmark = pytest.mark.slow

WARM_UP_S, SOAK_S = 15.0, 45.0
NUM_CLIENTS = 6
RSS_GROWTH_MB = 100
MAX_MODEL_LEN = 1024
# 64 blocks of 16 tokens: prompts of up to 600 tokens from six clients preempt and wait. The
# whole cache is ~45 MiB (fp32): its pages, written as blocks are first used, cannot explain
# the growth this test bounds.
ARGS = (
    "--num-kv-blocks",
    "64",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-batched-tokens",
    str(CPU_MAX_NUM_BATCHED_TOKENS),
    "--request-timeout",
    "8",
)


async def one_request(http_client: aiohttp.ClientSession, rng: random.Random) -> str:
    """One random request; returns what the client did."""
    kind = rng.choice(["stream", "drop", "cancel", "plain_n2", "deadline"])
    prompt_len = rng.choice([8, 40, 200, 600])
    prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 48), "ignore_eos": True}
    if kind == "deadline":  # cannot finish in the request timeout: a 408
        body["max_tokens"] = MAX_MODEL_LEN - prompt_len
    if kind in ("stream", "drop", "deadline"):
        body["stream"] = True
        async with http_client.post("/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            drop_after = rng.randint(0, 4) if kind == "drop" else None
            num = 0
            async for line in r.content:
                if drop_after is not None and num >= drop_after:
                    r.close()  # the client goes away mid-stream
                    break
                num += line.startswith(b"data: {")
        return kind
    if kind == "plain_n2":
        body["n"] = 2
        async with http_client.post("/v1/completions", json=body) as r:
            assert r.status in (200, 408), await r.text()  # 408: queued past the deadline
        return kind
    try:  # cancel: the client gives up before (or while) the prompt is prefilled
        r = await asyncio.wait_for(
            http_client.post("/v1/completions", json=body), rng.uniform(0, 1.5)
        )
        r.release()
    except asyncio.TimeoutError:
        pass
    return kind


async def clients(url: str, seconds: float, seed: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def client(rng: random.Random) -> None:
        async with aiohttp.ClientSession(url) as http_client:
            while time.monotonic() < deadline:
                kind = await one_request(http_client, rng)
                counts[kind] = counts.get(kind, 0) + 1

    await asyncio.gather(*(client(random.Random(seed * 100 + i)) for i in range(NUM_CLIENTS)))
    return counts


async def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    async with aiohttp.ClientSession(url) as http_client:
        deadline = time.monotonic() + timeout
        while True:
            now = gauges(await (await http_client.get("/metrics")).text())
            if not any(now.values()) or time.monotonic() > deadline:
                return now
            await asyncio.sleep(0.2)


def test_soak_returns_to_idle_with_flat_memory(tmp_path, smollm2_path):
    server = Server(tmp_path, *ARGS)
    try:
        asyncio.run(clients(server.url, WARM_UP_S, seed=1))
        assert not any(asyncio.run(wait_idle(server.url)).values())
        warm = server.rss_mb()
        counts = asyncio.run(clients(server.url, SOAK_S, seed=2))
        idle = asyncio.run(wait_idle(server.url))
        rss = server.rss_mb()
        assert idle == {
            "num_requests_running": 0.0,
            "num_requests_waiting": 0.0,
            "kv_cache_usage_perc": 0.0,
        }, idle
        assert sum(counts.values()) >= 20 and len(counts) == 5, counts
        assert rss - warm < RSS_GROWTH_MB, (warm, rss)
        code, _ = server.terminate(30)
        assert code == 0
        assert "Traceback" not in server.log(), server.log()[-3000:]
    finally:
        server.kill()
