"""Echo and prompt logprobs through the `openai` client against a live server (serve/echo.py):
`echo` on /v1/completions (the prompt's tokens, first logprob null, then the completion's),
`max_tokens: 0` with echo (lm-eval's loglikelihood), vLLM's `prompt_logprobs` on both APIs, and
`logprobs: 0` shaped like vLLM's. The prompt's logprobs are checked against transformers'
log_softmax over the same tokens."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_server import CHAT, oai, serving, sse_events

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
ATOL = 1e-3  # logprobs, ours (fp32) vs transformers (fp32)


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


@pytest.fixture(scope="module")
def reference(engine, hf_smollm2):
    """ids -> transformers' log_softmax over the prompt: entry i scores token i from position
    i - 1 (entry 0: None)."""

    def score(ids: list[int]) -> list[dict | None]:
        with torch.no_grad():
            lp = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
        out: list[dict | None] = [None]
        for i in range(1, len(ids)):
            top = lp[i - 1].topk(2)
            out.append(
                {"logprob": lp[i - 1, ids[i]].item(), "top": top.indices.tolist(), "row": lp[i - 1]}
            )
        return out

    return score


def run(coro_fn, engine, **config):
    async def go():
        async with serving(engine, **config) as client:
            c = oai(client)
            try:
                return await coro_fn(client, c)
            finally:
                await c.close()

    return asyncio.run(go())


def test_echo_logprobs_equal_the_prompts_logprobs(engine, reference):
    """echo + logprobs: prompt then completion in text, tokens, token_logprobs (the first null),
    top_logprobs (the first null) and text_offset; the prompt's logprobs are transformers'."""
    ids = engine.tokenizer.encode(PROMPT)

    async def go(client, c):
        echo = await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True
        )
        plain = await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
        )
        return echo, plain

    echo, plain = run(go, engine)
    choice, lp, want = echo.choices[0], echo.choices[0].logprobs, reference(ids)
    completion = plain.choices[0]
    assert choice.text == PROMPT + completion.text
    num = len(ids)
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in ids] + completion.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, num):
        assert lp.token_logprobs[i] == pytest.approx(want[i]["logprob"], abs=ATOL), i
        top_ids = want[i]["top"]
        shown = {engine.tokenizer.decode([t]) for t in top_ids}
        assert set(lp.top_logprobs[i]) == shown, i
        for t in top_ids:
            got = lp.top_logprobs[i][engine.tokenizer.decode([t])]
            assert got == pytest.approx(want[i]["row"][t].item(), abs=ATOL)
    # the completion's part is the plain request's (same greedy tokens and logprobs)
    assert lp.token_logprobs[num:] == pytest.approx(completion.logprobs.token_logprobs, abs=1e-5)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    assert echo.usage.prompt_tokens == num and echo.usage.completion_tokens == 4
    # vLLM also lists them as the choice's prompt_logprobs when echo asks for logprobs
    extra = choice.model_extra["prompt_logprobs"]
    assert extra[0] is None and len(extra) == num


def test_echo_with_max_tokens_0_is_the_prompt_alone(engine, reference):
    """max_tokens 0 + echo (what lm-eval's loglikelihood sends with its context and
    continuation as token ids): the prompt's text and logprobs only."""
    ids = engine.tokenizer.encode("Paris is the capital of France")

    async def go(client, c):
        r = await c.completions.create(
            model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True
        )
        lm_eval = await c.completions.create(  # lm-eval 0.4's payload: one token past the prompt
            model=MODEL, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234
        )
        return r, lm_eval

    r, lm_eval = run(go, engine)
    choice, want = r.choices[0], reference(ids)
    assert choice.text == engine.tokenizer.decode(ids)
    assert len(choice.logprobs.tokens) == len(ids)
    got = choice.logprobs.token_logprobs
    assert got[0] is None
    assert got[1:] == pytest.approx([w["logprob"] for w in want[1:]], abs=ATOL)
    assert r.usage.prompt_tokens == len(ids)
    # lm-eval reads token_logprobs[ctxlen:-1] and is_greedy from top_logprobs
    lp = lm_eval.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[: len(ids)] == pytest.approx(got, abs=1e-5)
    for tok, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) == 1 and max(top.values()) >= tok


def test_logprobs_0_shaped_like_vllm(engine):
    """logprobs 0: top_logprobs lists the sampled token alone (vLLM), not null."""

    async def go(client, c):
        return await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0
        )

    r = run(go, engine)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 3
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: value}


def test_echo_streamed(engine):
    """Streaming: each choice's first chunk carries the prompt (text and logprobs); the rest is
    the stream it would be without echo; n=2 choices both echo."""
    ids = engine.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1, "n": 2}

    async def go(client, c):
        streamed = await sse_events(
            await client.post("/v1/completions", json={**body, "echo": True, "stream": True})
        )
        whole = await (await client.post("/v1/completions", json={**body, "echo": True})).json()
        plain = await client.post("/v1/completions", json={**body, "echo": False, "stream": True})
        return streamed, whole, await sse_events(plain)

    streamed, whole, plain = run(go, engine)
    assert streamed[-1] == "[DONE]" and plain[-1] == "[DONE]"
    for index in (0, 1):
        chunks = [e["choices"][0] for e in streamed[:-1] if e["choices"][0]["index"] == index]
        text = "".join(c["text"] for c in chunks)
        lp = {k: sum((c["logprobs"][k] for c in chunks), []) for k in chunks[0]["logprobs"]}
        assert chunks[0]["text"].startswith(PROMPT)
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        assert len(chunks[0]["logprobs"]["tokens"]) > len(ids)  # prompt + first token
        full = whole["choices"][index]
        assert text == full["text"]
        assert lp["tokens"] == full["logprobs"]["tokens"]
        assert lp["text_offset"] == full["logprobs"]["text_offset"]
        assert lp["token_logprobs"][1:] == pytest.approx(full["logprobs"]["token_logprobs"][1:])
        alone = "".join(
            e["choices"][0]["text"] for e in plain[:-1] if e["choices"][0]["index"] == index
        )
        assert text == PROMPT + alone


def test_echo_streamed_with_max_tokens_0(engine):
    async def go(client, c):
        body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0, "stream": True}
        return await sse_events(await client.post("/v1/completions", json=body))

    events = run(go, engine)
    choices = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == PROMPT
    tokens = sum((c["logprobs"]["tokens"] for c in choices if c["logprobs"]), [])
    assert "".join(tokens) == PROMPT
    assert choices[-1]["finish_reason"] == "length"


def test_prompt_logprobs_on_completions_and_chat(engine, reference):
    """vLLM's prompt_logprobs: completions per choice, chat on the response; None first, then
    {token id: {logprob, rank, decoded_token}}, the scored token first, then the top k."""
    tok = engine.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    prompt_ids = tok.encode(PROMPT)

    async def go(client, c):
        comp = await c.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            temperature=0,
            n=2,
            extra_body={"prompt_logprobs": 2},
        )
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=2,
            temperature=0,
            extra_body={"prompt_logprobs": 0},
        )
        return comp, chat

    comp, chat = run(go, engine)
    for choice in comp.choices:
        assert choice.logprobs is None  # no logprobs asked for the completion
        check_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], prompt_ids, 2, tok)
    got = chat.model_extra["prompt_logprobs"]
    check_vllm_prompt_logprobs(got, chat_ids, 0, tok)
    want = reference(chat_ids)
    for i in range(1, len(chat_ids)):
        value = got[i][str(chat_ids[i])]["logprob"]
        assert value == pytest.approx(want[i]["logprob"], abs=ATOL), i


def check_vllm_prompt_logprobs(entries, ids, k, tok) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], 1):
        keys = list(entry)
        assert keys[0] == str(ids[i])  # the scored token first
        assert k <= len(keys) <= k + 1
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert ranks == list(range(1, k + 1))
        for key, v in entry.items():
            assert (
                v["decoded_token"] == tok.decode([int(key)], skip_special_tokens=False)
                and v["logprob"] <= 0
            )
        by_rank = sorted((v for v in entry.values() if v["rank"]), key=lambda v: v["rank"])
        assert [v["logprob"] for v in by_rank] == sorted(
            (v["logprob"] for v in by_rank), reverse=True
        )


def test_echo_and_prompt_logprobs_errors_are_openai_shaped(engine):
    bad = [
        ({"prompt": "x", "echo": 1}, "echo"),
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # without echo, 0 tokens is no request
    ]

    async def go(client, c):
        out = []
        for body, _ in bad:
            r = await client.post("/v1/completions", json=body)
            out.append((r.status, await r.text()))
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "prompt_logprobs": 3, "stream": True},
        )
        out.append((chat.status, await chat.text()))
        return out

    results = run(go, engine)
    for (status, text), param in zip(results, [p for _, p in bad] + ["prompt_logprobs"]):
        assert status == 400, (param, text)
        error = json.loads(text)["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", text
