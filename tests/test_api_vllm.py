"""vLLM-compatible details through the `openai` client against a live server: completions'
default max_tokens (16), return_token_ids, stream_options.continuous_usage_stats,
truncate_prompt_tokens, add_generation_prompt / continue_final_message (chat and /tokenize),
custom roles, the seed's range, /version, /v1/models (root, max_model_len), several served model
names, and --generation-config defaults; every client mistake an OpenAI-shaped 400."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_server import CHAT, oai, serving, sse_events

from tinyserve.model.config import sampling_defaults
from tinyserve.serve import protocol
from tinyserve.serve.server import VERSION, ServerConfig, generation_defaults

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
PREFILL = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour I pick is"},
]


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


def run(coro_fn, engine, **config):
    async def go():
        async with serving(engine, **config) as client:
            c = oai(client)
            try:
                return await coro_fn(client, c)
            finally:
                await c.close()

    return asyncio.run(go())


def test_completions_default_max_tokens_is_16(engine):
    async def go(client, c):
        comp = await c.completions.create(
            model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}
        )
        null = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": None, "ignore_eos": True}
        )
        return comp, await null.json()

    comp, null = run(go, engine)
    assert comp.usage.completion_tokens == 16 and comp.choices[0].finish_reason == "length"
    assert null["usage"]["completion_tokens"] == 16
    # chat: up to the context (OpenAI's default)
    info = protocol.ModelInfo((MODEL,), engine.max_model_len, engine.model_config.vocab_size, 16)
    assert protocol.parse_chat({"messages": CHAT}, info).params.max_tokens is None
    assert protocol.parse_completion({"prompt": "x"}, info).params.max_tokens == 16


def test_return_token_ids(engine):
    tok = engine.tokenizer
    prompt_ids = tok.encode(PROMPT)
    chat_ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    extra = {"return_token_ids": True}

    async def go(client, c):
        comp = await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra
        )
        chat = await c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body=extra
        )
        body = {"max_tokens": 4, "temperature": 0, "stream": True, **extra}
        comp_s = await client.post("/v1/completions", json={"prompt": PROMPT, **body})
        comp_s = await sse_events(comp_s)
        chat_s = await sse_events(
            await client.post("/v1/chat/completions", json={"messages": CHAT, **body})
        )
        return comp, chat, comp_s, chat_s

    comp, chat, comp_s, chat_s = run(go, engine)
    choice = comp.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt_ids
    assert tok.decode(choice["token_ids"]) == comp.choices[0].text
    assert len(choice["token_ids"]) == comp.usage.completion_tokens
    assert chat.model_extra["prompt_token_ids"] == chat_ids
    ids = chat.choices[0].model_extra["token_ids"]
    assert tok.decode(ids) == chat.choices[0].message.content
    # streamed: prompt ids once (the first chunk), each chunk's new token ids
    chunks = [e["choices"][0] for e in comp_s[:-1]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    assert sum((ch["token_ids"] for ch in chunks), []) == choice["token_ids"]
    assert chat_s[0]["prompt_token_ids"] == chat_ids  # the role chunk, at the top level
    assert "prompt_token_ids" not in chat_s[1]
    assert sum((e["choices"][0].get("token_ids", []) for e in chat_s[1:-1]), []) == ids


def test_continuous_usage_stats(engine):
    async def go(client, c):
        chunks = [
            ch
            async for ch in await c.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=5,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True},
            )
        ]
        plain = await client.post(
            "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        return chunks, await sse_events(plain)

    chunks, plain = run(go, engine)
    num_prompt = len(engine.tokenizer.encode(PROMPT))
    *steps, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    counts = [ch.usage.completion_tokens for ch in steps]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert all(ch.usage.prompt_tokens == num_prompt for ch in steps)
    assert all(ch.usage.total_tokens == num_prompt + ch.usage.completion_tokens for ch in steps)
    assert all(e["usage"] is None for e in plain[:-2])  # without it: usage on the last chunk only


def test_truncate_prompt_tokens(engine):
    ids = engine.tokenizer.encode("one two three four five six seven eight nine ten")
    body = {"max_tokens": 4, "temperature": 0}

    async def go(client, c):
        cut = await c.completions.create(
            model=MODEL, prompt=ids, extra_body={"truncate_prompt_tokens": 5}, **body
        )
        last5 = await c.completions.create(model=MODEL, prompt=ids[-5:], **body)
        first5 = await c.completions.create(
            model=MODEL,
            prompt=ids,
            extra_body={"truncate_prompt_tokens": 5, "truncation_side": "right"},
            **body,
        )
        echo = await c.completions.create(
            model=MODEL, prompt=ids, echo=True, extra_body={"truncate_prompt_tokens": 3}, **body
        )
        whole = await c.completions.create(
            model=MODEL, prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **body
        )
        chat = await c.chat.completions.create(
            model=MODEL, messages=CHAT, extra_body={"truncate_prompt_tokens": 6}, **body
        )
        return cut, last5, first5, echo, whole, chat

    cut, last5, first5, echo, whole, chat = run(go, engine)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == last5.choices[0].text
    assert first5.usage.prompt_tokens == 5
    assert echo.choices[0].text.startswith(engine.tokenizer.decode(ids[-3:]))
    assert whole.usage.prompt_tokens == len(ids)  # -1: the context length, no cut here
    assert chat.usage.prompt_tokens == 6


def test_add_generation_prompt_and_continue_final_message(engine):
    tok = engine.tokenizer

    def ids_of(messages, **kw):
        return tok.encode(tok.apply_chat_template(messages, **kw), add_special_tokens=False)

    async def go(client, c):
        async def tokenize(**kw):
            r = await client.post("/tokenize", json={"messages": PREFILL, **kw})
            return (await r.json())["tokens"]

        plain = await tokenize()
        no_prompt = await tokenize(add_generation_prompt=False)
        cont = await tokenize(add_generation_prompt=False, continue_final_message=True)
        only_cont = await tokenize(continue_final_message=True)  # the default steps aside
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=PREFILL,
            max_tokens=3,
            temperature=0,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )
        completion = await c.completions.create(
            model=MODEL,
            prompt=ids_of(PREFILL, add_generation_prompt=False, continue_final_message=True),
            max_tokens=3,
            temperature=0,
        )
        return plain, no_prompt, cont, only_cont, chat, completion

    plain, no_prompt, cont, only_cont, chat, completion = run(go, engine)
    assert plain == ids_of(PREFILL)
    assert no_prompt == ids_of(PREFILL, add_generation_prompt=False)
    want = ids_of(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert cont == only_cont == want
    assert tok.decode(want).endswith("The colour I pick is")
    assert len(want) < len(no_prompt) < len(plain)
    # the chat continues the assistant's message: the same tokens as that prompt completed
    assert chat.usage.prompt_tokens == len(want)
    assert chat.choices[0].message.content == completion.choices[0].text


def test_custom_roles_the_template_accepts(engine):
    """Any role string reaches the template (SmolLM2's renders any role); non-strings are 400."""
    tok = engine.tokenizer
    messages = [{"role": "wizard", "content": "Cast a spell."}, {"role": "user", "content": "Hi"}]

    async def go(client, c):
        chat = await c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0
        )
        bad = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": 5, "content": "Hi"}]}
        )
        return chat, bad.status, await bad.json()

    chat, status, error = run(go, engine)
    want = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert chat.usage.prompt_tokens == len(want)
    assert "<|im_start|>wizard" in tok.apply_chat_template(messages)
    assert status == 400 and error["error"]["param"] == "messages"


def test_seed_range_version_and_models(engine):
    async def go(client, c):
        ok = []
        for seed in (-(2**63), 2**63 - 1):
            r = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=1, seed=seed)
            ok.append(r.usage.completion_tokens)
        bad = []
        for seed in (2**63, -(2**63) - 1):
            r = await client.post("/v1/completions", json={"prompt": "Hi", "seed": seed})
            bad.append((r.status, await r.json()))
        version = await (await client.get("/version")).json()
        models = await c.models.list()
        return ok, bad, version, models

    ok, bad, version, models = run(go, engine)
    assert ok == [1, 1]
    for status, body in bad:
        assert status == 400 and body["error"]["param"] == "seed"
    assert version == {"version": VERSION} and VERSION != "unknown"
    (card,) = models.data
    assert card.id == MODEL and card.owned_by == "tinyserve"
    assert card.model_extra["root"] == engine.config.model
    assert card.model_extra["max_model_len"] == engine.max_model_len


def test_several_served_model_names(engine):
    names = ("smol", "smol-alias")

    async def go(client, c):
        models = await c.models.list()
        first = await c.completions.create(model="smol", prompt="Hi", max_tokens=1)
        second = await c.completions.create(model="smol-alias", prompt="Hi", max_tokens=1)
        missing = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        return models, first, second, missing.status

    models, first, second, missing = run(go, engine, served_model_name=names)
    assert [m.id for m in models.data] == list(names)
    assert first.model == second.model == "smol"  # the first name is the one reported
    assert missing == 404


def test_generation_config_defaults(engine, tmp_path):
    """--generation-config DIR: its sampling fields fill what a request leaves unset, and its
    max_new_tokens caps an unset max_tokens; 'vllm' ignores the file; 'auto' reads the model's."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": False})
    )
    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    assert generation_defaults(ServerConfig(generation_config="vllm"), str(tmp_path)) == {}
    auto = ServerConfig(generation_config="auto")
    assert generation_defaults(auto, str(tmp_path)) == sampling_defaults(tmp_path)
    assert generation_defaults(auto, engine.config.model) == {}  # SmolLM2's sets no sampling
    with pytest.raises(ValueError, match="generation_config"):
        ServerConfig(generation_config=str(tmp_path / "missing"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults(tmp_path / "bad")

    async def go(client, c):
        seeded = []
        for seed in (1, 2):  # temperature 0 by default: the seed changes nothing
            r = await c.chat.completions.create(model=MODEL, messages=CHAT, seed=seed)
            seeded.append(r)
        asked = await c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        return seeded, asked

    seeded, asked = run(go, engine, generation_config=str(tmp_path))
    assert all(r.usage.completion_tokens <= 3 for r in seeded)
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
    assert asked.usage.completion_tokens == 6  # the request's own max_tokens wins
    assert asked.choices[0].message.content.startswith(seeded[0].choices[0].message.content)


def test_vllm_extras_errors_are_openai_shaped(engine):
    cases = [
        ("/v1/completions", {"prompt": "x", "return_token_ids": 1}, "return_token_ids"),
        ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (
            "/v1/completions",
            {"prompt": "x", "truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "truncate_prompt_tokens": 10**6},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "truncate_prompt_tokens": "5"},
            "truncate_prompt_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "up"},
            "truncation_side",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "y"}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "add_generation_prompt": "no"},
            "add_generation_prompt",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "continue_final_message": 1},
            "continue_final_message",
        ),
        ("/tokenize", {"messages": CHAT, "continue_final_message": 1}, "continue_final_message"),
        ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "r" * 65, "content": "x"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "seed": 2**64}, "seed"),
    ]

    async def go(client, c):
        out = []
        for url, body, _ in cases:
            r = await client.post(url, json=body)
            out.append((r.status, await r.text()))
        return out

    for (status, text), (url, _, param) in zip(run(go, engine), cases):
        assert status == 400, (url, param, text)
        error = json.loads(text)["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", text
        assert "Traceback" not in text
