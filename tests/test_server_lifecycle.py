"""Request lifecycle under stress (checklist items 14-18, 21, 22): disconnects, queueing,
preemption, backpressure, deadlines, drain, health and crash isolation.

After every scenario the shared engine is idle with every KV block free (checked by `serving`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time

import aiohttp
import pytest
from test_server import CHAT, assert_clean, serving, wait_idle

from tinyserve import LLM, AsyncEngine
from tinyserve.serve.responses import ResponseBuilder
from tinyserve.serve.server import STATE, ServerConfig, drain, serve

pytestmark = pytest.mark.slow

LONG = {"messages": CHAT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


async def serve_in_process(engine) -> tuple[asyncio.Future, str]:
    """serve() on this loop, on a free port: its task and its URL, once it listens."""
    urls = []
    server = asyncio.ensure_future(serve(AsyncEngine(engine), ServerConfig(port=0), urls.append))
    while not urls:
        await asyncio.sleep(0.01)
    return server, urls[0]


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


@pytest.fixture
def step_count(engine, monkeypatch):
    """Counts engine steps as they start (the AsyncEngine calls `engine.step` per step)."""
    count = [0]
    step = engine.step

    def counting_step():
        count[0] += 1
        return step()

    monkeypatch.setattr(engine, "step", counting_step)
    return count


async def first_content(resp) -> dict:
    """Read SSE events until the first one with generated content."""
    async for line in resp.content:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            choice = event["choices"][0] if event["choices"] else {}
            if choice.get("delta", {}).get("content") or choice.get("text"):
                return event
    raise AssertionError("the stream ended before any content")


async def events(resp) -> list:
    text = await resp.text()
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in text.split("\n\n")[:-1]]


def test_14_disconnect_storm_frees_blocks_within_two_steps(engine, step_count):
    async def go():
        async with serving(engine) as client:
            baseline = engine.pool.num_free_blocks
            body = {**LONG, "stream": True}
            resps = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(50))
            )
            await asyncio.gather(*(first_content(r) for r in resps))
            assert engine.pool.num_free_blocks < baseline
            for r in resps:
                r.close()  # drop the connection
            closed_at = step_count[0]
            await wait_idle(engine)
            steps = step_count[0] - closed_at
            engine.check_invariants()
            assert engine.pool.num_free_blocks == baseline
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4})
            assert r.status == 200 and time.perf_counter() - t0 < 5
            metrics = await (await client.get("/metrics")).text()
            return steps, metrics

    steps, metrics = asyncio.run(go())
    assert steps <= 2, steps
    assert 'outcome="aborted"} 50.0' in metrics


def test_15_disconnect_while_queued_never_prefills(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "max_num_seqs", 2)
    scheduled = set()
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        scheduled.update(s.request_id for s in (batch.seqs if batch else []))
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)

    async def go():
        async with serving(engine) as client:
            running = [
                await client.post("/v1/chat/completions", json={**LONG, "stream": True})
                for _ in range(2)
            ]
            await asyncio.gather(*(first_content(r) for r in running))
            queued = [
                asyncio.ensure_future(
                    client.post(
                        "/v1/completions", json={"prompt": f"Queued request {i}", "max_tokens": 4}
                    )
                )
                for i in range(20)
            ]
            for _ in range(500):
                if len(engine.scheduler.waiting) == 20:
                    break
                await asyncio.sleep(0.01)
            assert len(engine.scheduler.waiting) == 20
            for task in queued:
                task.cancel()  # the client gives up: its connection closes
            await asyncio.gather(*queued, return_exceptions=True)
            for _ in range(500):
                if not engine.scheduler.waiting:
                    break
                await asyncio.sleep(0.01)
            assert not engine.scheduler.waiting
            assert len(scheduled) == 2  # only the two running requests were ever scheduled
            for r in running:
                r.close()

    asyncio.run(go())


@pytest.fixture(scope="module")
def small_llm(smollm2_path):
    # 12 blocks of 16 tokens: 8 requests of 44 tokens need 24 blocks, so they must preempt
    return LLM(smollm2_path, dtype="float32", device="cpu", seed=0, num_kv_blocks=12)


def test_16_preemption_under_kv_pressure_same_outputs(engine, small_llm):
    prompts = [[1000 + 37 * i + j for j in range(20)] for i in range(8)]

    async def run_all(eng, **config):
        async with serving(eng, **config) as client:

            async def one(p):
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
                )
                assert r.status == 200, await r.text()
                return (await r.json())["choices"][0]["text"]

            texts = await asyncio.gather(*(one(p) for p in prompts))
            too_big = await client.post(
                "/v1/completions", json={"prompt": prompts[0] * 9, "max_tokens": 20}
            )
            return texts, too_big.status, (await too_big.json())

    small = small_llm.engine
    before = small.scheduler.num_preemptions
    pressured, status, err = asyncio.run(run_all(small))
    assert small.scheduler.num_preemptions > before
    reference, _, _ = asyncio.run(run_all(engine))
    assert pressured == reference
    # a request that cannot fit the whole pool is refused at admission, not deadlocked
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"


def test_7_clamp_max_tokens_flag(small_llm):
    limit = small_llm.engine.max_model_len  # 192: the whole pool

    async def go():
        async with serving(small_llm.engine, clamp_max_tokens=True) as client:
            r = await client.post(
                "/v1/completions",
                json={
                    "prompt": list(range(1000, 1000 + limit - 3)),
                    "max_tokens": 100,
                    "ignore_eos": True,
                },
            )
            return r.status, await r.json()

    status, body = asyncio.run(go())
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_17_backpressure_429_with_retry_after(engine):
    async def go():
        async with serving(engine, max_waiting=4) as client:
            body = {"messages": CHAT, "max_tokens": 4}
            resps = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(20))
            )
            out = [(r.status, r.headers.get("Retry-After"), await r.json()) for r in resps]
            st = client.app[STATE]
            assert st.num_waiting == 0 and not st.flights  # nothing left behind
            return out

    out = asyncio.run(go())
    ok = [b for s, _, b in out if s == 200]
    busy = [(h, b) for s, h, b in out if s == 429]
    assert len(ok) + len(busy) == 20 and len(ok) >= 4 and busy
    assert all(h == "1" and b["error"]["code"] == "server_busy" for h, b in busy)
    assert all(b["usage"]["completion_tokens"] >= 1 for b in ok)


def test_18_request_deadline(engine):
    async def go():
        async with serving(engine, request_timeout=1.0) as client:
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json={**LONG, "stream": True})
            evs = await events(r)
            t_stream = time.perf_counter() - t0
            t0 = time.perf_counter()
            r2 = await client.post("/v1/chat/completions", json=LONG)
            return evs, t_stream, r2.status, await r2.json(), time.perf_counter() - t0

    evs, t_stream, status, body, t_plain = asyncio.run(go())
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == "request_timeout"
    assert not any(e["choices"][0]["finish_reason"] for e in evs[:-2])
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert 1.0 <= t_stream < 2.5 and 1.0 <= t_plain < 2.5


def test_21_drain_finishes_or_aborts_in_flight(engine):
    async def go(timeout: float, max_tokens: int):
        async with serving(engine) as client:
            body = {**LONG, "stream": True, "max_tokens": max_tokens}
            resps = [await client.post("/v1/chat/completions", json=body) for _ in range(3)]
            draining = asyncio.ensure_future(drain(client.app, timeout))
            await asyncio.sleep(0.05)
            refused = await client.post("/v1/chat/completions", json=body)
            health = await client.get("/health")
            finished = [await events(r) for r in resps]
            await draining
            return refused.status, health.status, finished

    refused, health, finished = asyncio.run(go(10.0, 12))
    assert refused == 503 and health == 503
    for evs in finished:  # they ran to the end
        assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] == "length"
    t0 = time.perf_counter()
    refused, health, finished = asyncio.run(go(0.0, 2000))
    assert time.perf_counter() - t0 < 10
    for evs in finished:
        assert evs[-1] == "[DONE]" and evs[-2]["choices"][0]["finish_reason"] == "abort"


def test_22_health_under_load_and_one_request_fault(engine, monkeypatch):
    response, delta_chunk = ResponseBuilder.response, ResponseBuilder.delta_chunk

    def faulty(original):
        def method(self, *args):
            if self.top_logprobs == 1:  # the victim asks for exactly one top logprob
                raise RuntimeError("injected post-processing fault")
            return original(self, *args)

        return method

    monkeypatch.setattr(ResponseBuilder, "response", faulty(response))
    monkeypatch.setattr(ResponseBuilder, "delta_chunk", faulty(delta_chunk))

    async def go():
        async with serving(engine) as client:
            assert (await client.get("/health")).status == 200
            body = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            victim = {**body, "logprobs": True, "top_logprobs": 1}
            healthy = [
                client.post("/v1/chat/completions", json={**body, "stream": s})
                for s in (True, False, True, False)
            ]
            victims = [
                client.post("/v1/chat/completions", json={**victim, "stream": s})
                for s in (True, False)
            ]
            tasks = [asyncio.ensure_future(c) for c in healthy + victims]
            latencies = []
            while not all(t.done() for t in tasks):
                t0 = time.perf_counter()
                assert (await client.get("/health")).status == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.01)
            resps = [t.result() for t in tasks]
            return (
                resps,
                [
                    await events(r) if i in (0, 2, 4) else (r.status, await r.json())
                    for i, r in enumerate(resps)
                ],
                sorted(latencies),
            )

    resps, results, latencies = asyncio.run(go())
    assert results[0][-2]["choices"][0]["finish_reason"] == "length"
    assert results[1][0] == 200 and results[1][1]["usage"]["completion_tokens"] == 16
    assert results[4][-1] == "[DONE]" and results[4][-2]["error"]["type"] == "server_error"
    assert results[5][0] == 500 and "injected" not in json.dumps(results[5][1])
    assert latencies[int(0.99 * (len(latencies) - 1))] < 0.1, latencies[-5:]


def test_22_fatal_engine_error_health_503_and_exit_code_1(engine, monkeypatch):
    fail = [False]
    step = engine.step

    def failing_step():
        if fail[0]:
            raise RuntimeError("injected fatal step error")
        return step()

    monkeypatch.setattr(engine, "step", failing_step)

    async def stream_until_error(session) -> dict:
        r = await session.post("/v1/chat/completions", json={**LONG, "stream": True})
        await first_content(r)
        fail[0] = True
        evs = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
        return evs[-1]

    async def in_app():
        async with serving(engine) as client:
            last = await stream_until_error(client)
            health = await client.get("/health")
            refused = await client.post("/v1/chat/completions", json=LONG)
            fail[0] = False  # let `serving` clean the engine up
            return last, health.status, await refused.json()

    async def in_serve():
        server, url = await serve_in_process(engine)
        async with aiohttp.ClientSession(url) as session:
            last = await stream_until_error(session)
        return last, await asyncio.wait_for(server, 10)

    try:
        last, health, refused = asyncio.run(in_app())
        assert last["error"]["code"] == "engine_dead" and "injected" not in json.dumps(last)
        assert health == 503 and refused["error"]["code"] == "engine_dead"
        last, code = asyncio.run(in_serve())
        assert last["error"]["code"] == "engine_dead" and code == 1
    finally:
        fail[0] = False
        assert_clean(engine, strict=False)


def test_serve_freezes_the_start_up_heap_while_it_serves(engine):
    """A full garbage collection walks every live object (~195k once SmolLM2 is loaded), and
    no stream steps meanwhile. serve() moves them out of the collector's reach when the engine
    is up (gc.freeze) and hands them back when it returns."""

    async def in_serve():
        server, _ = await serve_in_process(engine)
        frozen = gc.get_freeze_count()
        os.kill(os.getpid(), signal.SIGTERM)  # a clean shutdown
        return frozen, await asyncio.wait_for(server, 10)

    frozen, code = asyncio.run(in_serve())
    assert code == 0 and frozen > 10_000
    assert gc.get_freeze_count() == 0
    assert_clean(engine)
