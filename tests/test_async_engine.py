"""AsyncEngine: incremental deltas, concurrent streams, abort on early exit, loop stays free."""

from __future__ import annotations

import asyncio
import time

import pytest

from tinyserve import AsyncEngine, InvalidParameter, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine  # share the loaded weights; AsyncEngine wraps an LLMEngine


def run(coro):
    return asyncio.run(coro)


def test_stream_deltas_add_up_to_offline_result(engine, smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = smollm2_llm.generate(["Hello there,"], params, use_tqdm=False)[0].outputs[0]

    async def go():
        ae = AsyncEngine(engine)
        deltas = [d async for d in ae.generate("a", "Hello there,", params)]
        await ae.close()
        return deltas

    deltas = run(go())
    assert len(deltas) == 20 and deltas[-1].finished and not deltas[0].finished
    assert sum((d.outputs[0].token_ids for d in deltas), []) == ref.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == ref.text
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_concurrent_streams_and_abort_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def consume(ae, rid, limit):
        n = 0
        async for _ in ae.generate(rid, "Tell me a story.", params):
            n += 1
            if n == limit:
                break  # leaving early aborts the request
        return n

    async def go():
        ae = AsyncEngine(engine)
        counts = await asyncio.gather(*(consume(ae, f"r{i}", 3 + i) for i in range(6)))
        for _ in range(100):  # the abort is processed by the next engine step
            if not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        await ae.close()
        return counts

    assert run(go()) == [3, 4, 5, 6, 7, 8]
    engine.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_invalid_request_raises_before_streaming(engine):
    async def go():
        ae = AsyncEngine(engine)
        try:
            async for _ in ae.generate("bad", [], SamplingParams()):
                pass
        finally:
            await ae.close()

    with pytest.raises(InvalidParameter):
        run(go())
    assert not engine.has_unfinished()


def test_event_loop_stays_responsive_while_generating(engine):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def go():
        ae = AsyncEngine(engine)
        task = asyncio.gather(*(_drain(ae.generate(f"s{i}", "Count:", params)) for i in range(4)))
        gaps = []
        while not task.done():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            gaps.append(time.perf_counter() - t0)
        await task
        await ae.close()
        return sorted(gaps)

    gaps = run(go())
    assert gaps[int(0.99 * (len(gaps) - 1))] < 0.05, gaps[-5:]


async def _drain(gen):
    async for _ in gen:
        pass
