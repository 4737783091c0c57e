"""The OpenAI-compatible server, through the official `openai` client and raw SSE.

`serving(engine, **config)` (used by the other test_server_*.py files too) runs the app on
aiohttp's TestServer (handler cancellation on) around the session's SmolLM2 engine and checks on
exit that the engine is idle, its invariants hold and every KV block is free again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tinyserve import AsyncEngine
from tinyserve.serve.server import STATE, ServerConfig, build_app

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@contextlib.asynccontextmanager
async def serving(engine, **config):
    """A TestClient on a fresh app + AsyncEngine around the shared LLMEngine."""
    ae = AsyncEngine(engine)
    client = TestClient(TestServer(build_app(ae, ServerConfig(**config))))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        if ae.is_running:  # else a test killed it on purpose: just clean up
            await wait_idle(engine)
        st = client.app[STATE]
        await asyncio.sleep(0)  # handlers cancelled by the close above finish unwinding
        leaked = (len(st.flights), st.num_waiting)
        await ae.close()
        assert_clean(engine, strict=ae.is_running)
        assert leaked == (0, 0), leaked  # every request's bookkeeping was released


async def wait_idle(engine, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if not engine.has_unfinished():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle")


def assert_clean(engine, strict: bool = True) -> None:
    if engine.has_unfinished():  # leave the shared engine usable for the next test
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        assert not strict, "requests were left in the engine"
    engine.check_invariants()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def oai(client: TestClient, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), max_retries=0, **kw)


async def sse_events(resp) -> list:
    """Parse an SSE body into JSON objects (and the final '[DONE]' string)."""
    text = await resp.text()
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


def test_chat_with_openai_client_stream_and_not(engine):
    async def go():
        async with serving(engine) as client:
            c = oai(client)
            r = await c.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=12, temperature=0
            )
            chunks = [
                ch
                async for ch in await c.chat.completions.create(
                    model="SmolLM2-135M-Instruct",
                    messages=CHAT,
                    max_completion_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
            await c.close()
            return r, chunks

    r, chunks = asyncio.run(go())
    tok = engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "SmolLM2-135M-Instruct"
    assert r.choices[0].message.role == "assistant"
    text, num = r.choices[0].message.content, r.usage.completion_tokens
    assert "Paris" in text and 0 < num <= 12
    assert r.choices[0].finish_reason == ("length" if num == 12 else "stop")
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (len(prompt_ids), len(prompt_ids) + num)
    # the first request left the prompt's full blocks in the prefix cache
    bs = engine.pool.block_size
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (len(prompt_ids) - 1) // bs * bs > 0
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.id == chunks[0].id and ch.object == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[1:-1]) == text  # greedy
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == num
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_n_stop_logprobs_with_openai_client(engine):
    prompt = "The capital of France is"

    async def go():
        async with serving(engine) as client:
            c = oai(client)
            greedy = await c.completions.create(
                model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=10, temperature=0
            )
            stop = greedy.choices[0].text.split()[2]  # a word the greedy continuation reaches
            stopped = await c.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                stop=[stop],
            )
            sampled = await c.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=prompt,
                max_tokens=5,
                n=3,
                seed=1,
                temperature=1.0,
                logprobs=2,
                extra_body={"ignore_eos": True},
            )
            streamed = [
                ch
                async for ch in await c.completions.create(
                    model="SmolLM2-135M-Instruct",
                    prompt=prompt,
                    max_tokens=5,
                    n=3,
                    seed=1,
                    temperature=1.0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            ]
            await c.close()
            return greedy.choices[0].text, stop, stopped, sampled, streamed

    greedy, stop, stopped, sampled, streamed = asyncio.run(go())
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == greedy[: greedy.index(stop)]
    assert stopped.object == "text_completion"
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 15
    for choice in sampled.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    # same seed, same choices, streamed or not
    texts = {i: "" for i in range(3)}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in sampled.choices}


def test_chat_logprobs_and_top_logprobs(engine):
    async def go():
        async with serving(engine) as client:
            c = oai(client)
            r = await c.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=CHAT,
                max_tokens=4,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
            )
            await c.close()
            return r

    r = asyncio.run(go())
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the sampled token is the top one
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode() == t.token


def test_raw_sse_framing_chat_and_completions(engine):
    body = {
        "messages": CHAT,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
    }

    async def go():
        async with serving(engine) as client:
            r1 = await client.post("/v1/chat/completions", json=body)
            assert r1.headers["Content-Type"].startswith("text/event-stream")
            chat = await sse_events(r1)
            body2 = {"prompt": ["Hi", [1, 2, 3]], "max_tokens": 3, "stream": True}
            comp = await sse_events(await client.post("/v1/completions", json=body2))
            return chat, comp

    chat, comp = asyncio.run(go())
    assert chat[-1] == "[DONE]" and comp[-1] == "[DONE]"
    roles = [e for e in chat[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert [e["choices"][0]["index"] for e in roles] == [0, 1]  # role first, per choice
    assert chat[:2] == roles
    finished = [e["choices"][0]["index"] for e in chat[:-2] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    assert all("usage" in e and e["usage"] is None for e in chat[:-2])
    assert chat[-2]["choices"] == [] and chat[-2]["usage"]["completion_tokens"] == 8
    # two prompts x n=1: choice indices 0 and 1, each finishing once
    assert {e["object"] for e in comp[:-1]} == {"text_completion"}
    finished = [e["choices"][0]["index"] for e in comp[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_models_health_metrics_tokenize(engine):
    async def go():
        async with serving(engine) as client:
            r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            await r.read()
            models = await (await client.get("/v1/models")).json()
            card = await client.get("/v1/models/SmolLM2-135M-Instruct")
            missing = await client.get("/v1/models/nope")
            health = await client.get("/health")
            metrics = await (await client.get("/metrics")).text()
            tok = await (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
            chat_tok = await client.post("/tokenize", json={"messages": CHAT})
            detok = await client.post("/detokenize", json={"tokens": tok["tokens"]})
            return (
                models,
                card.status,
                missing.status,
                health.status,
                metrics,
                tok,
                (await chat_tok.json())["count"],
                await detok.json(),
            )

    models, card, missing, health, metrics, tok, chat_count, detok = asyncio.run(go())
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    assert models["data"][0]["max_model_len"] == engine.max_model_len
    assert (card, missing, health) == (200, 404, 200)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    for name in (
        "requests",
        "prompt_tokens",
        "generation_tokens",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert f"tinyserve:{name}" in families, name
    ok = [s for s in families["tinyserve:requests"].samples if s.labels.get("outcome") == "ok"]
    assert ok[0].value == 1
    gen = families["tinyserve:generation_tokens"].samples[0].value
    assert gen == 2
    assert tok["tokens"] == engine.tokenizer.encode("Hello world") and tok["count"] == 2
    assert chat_count > tok["count"]
    assert detok == {"prompt": "Hello world"}


def test_cache_salt_isolates_prefix_cache_between_tenants(engine):
    prompt = "A shared system prompt that is long enough to fill several KV blocks. " * 4

    async def go():
        async with serving(engine) as client:
            cached = []
            for salt in ("tenant-a", "tenant-b", "tenant-a"):
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt},
                )
                assert r.status == 200, await r.text()
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            bad = await client.post("/v1/completions", json={"prompt": "x", "cache_salt": 5})
            assert bad.status == 400
            assert (await bad.json())["error"]["param"] == "cache_salt"
            return cached

    a, b, a_again = asyncio.run(go())
    assert b == 0 and a_again > 0 and a_again >= a  # only the same tenant hits


def test_model_without_tokenizer_serves_token_ids(tmp_path):
    """Dummy benchmark shapes have no tokenizer.json: token-id prompts work, text gets a 400."""
    from tinyserve.config import EngineConfig
    from tinyserve.engine.llm_engine import LLMEngine

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu"))

    async def go():
        async with serving(engine) as client:
            ok = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
            text = await client.post("/v1/completions", json={"prompt": "hi"})
            chat = await client.post("/v1/chat/completions", json={"messages": CHAT})
            return ok.status, await ok.json(), text.status, chat.status, await chat.json()

    ok, body, text, chat, err = asyncio.run(go())
    assert ok == 200 and body["usage"]["completion_tokens"] == 3
    assert (text, chat) == (400, 400) and err["error"]["param"] == "messages"
