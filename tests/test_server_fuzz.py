"""Fuzz: 500 seeded, mutated bodies per POST route (200 on the Responses and Messages APIs' routes),
then hypothesis over every route's body schema. Never a 5xx, always the route's error shape on a
4xx (Anthropic's on /v1/messages, else OpenAI's), complete SSE streams on a 200, and the engine's
invariants (and /health) afterwards.

Mutated bodies start valid and take 1-3 random mutations (edge-case values for known fields,
dropped and unknown keys, wrong shapes, raw broken JSON). The hypothesis bodies follow each
route's schema, every field either plausible or any JSON value (wrong types, NaN, integers no
float holds, lone surrogates), some gzipped, whole or cut short. max_tokens is clamped small and
the model is a tiny random one with SmolLM2's tokenizer, so generation is quick.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import serving, wait_idle

from tinyserve import LLM
from tinyserve.serve.fields import ROLES

pytestmark = pytest.mark.slow

NUM_BODIES, BATCH = 500, 50
NUM_NEW_API_BODIES = 200  # /v1/responses and /v1/messages: their own schemas, then the same path
MODEL = "SmolLM2-135M-Instruct"
MSG = {"role": "user", "content": "Hi"}
BASE = {
    "/v1/chat/completions": {"model": MODEL, "messages": [MSG], "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": [MSG], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [MSG]},
}
NEW_APIS = ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
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
    "chat_template_kwargs",
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "store",
    "text",
    "reasoning",
    "system",
    "stop_sequences",
    "thinking",
    "metadata",
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


@pytest.fixture(scope="module")
def tiny_llm(smollm2_path, tmp_path_factory):
    """SmolLM2's tokenizer and chat template on a 2-layer, 64-wide Llama with random weights: the
    server does all its own work (parsing, validation, templates, tokenizing, streaming) while a
    model step costs next to nothing. Served under SmolLM2's name (the directory's)."""
    source = Path(smollm2_path)
    path = tmp_path_factory.mktemp("tiny") / source.name
    path.mkdir()
    config = json.loads((source / "config.json").read_text())
    config |= dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
    )
    (path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return LLM(str(path), dtype="float32", device="cpu", seed=0, load_format="dummy")


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
                    {"type": rng.choice(ITEM_TYPES), "call_id": "c", "name": "f", "output": "x"},
                    {"role": "user", "content": [{"type": rng.choice(BLOCK_TYPES), "id": "t"}]},
                ]
            )
            for _ in range(rng.randrange(1, 3))
        ]
    return [rng.choice(INTS[:9]) for _ in range(rng.randrange(1, 6))]  # token ids


ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "web_search_call"]
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "image", "document"]


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


def encode(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def check(client, url: str, body, coding: str = "identity") -> int:
    """`coding`: identity, gzip or cut-gzip (gzip that lost its last bytes)."""
    data, headers = encode(body), {"Content-Type": "application/json"}
    if coding != "identity":
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
        data = data[:-5] if coding == "cut-gzip" else data
    r = await client.post(url, data=data, headers=headers)
    text = await r.text()
    assert r.status < 500, (url, body, text)
    anthropic = url.startswith("/v1/messages")
    if r.status >= 400:
        err = json.loads(text)
        if anthropic:
            assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, text
        else:
            assert set(err["error"]) == {"message", "type", "param", "code"}, text
        assert "Traceback" not in text and ".py" not in text
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        last = text.rsplit("event: ", 1)[-1]
        if url == "/v1/responses":  # typed events, the last one the response's end
            assert last.startswith(("response.completed", "response.incomplete")), text[-200:]
        elif anthropic:
            assert last.startswith("message_stop"), text[-200:]
        else:
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
            assert '"error"' not in text, text
    else:
        json.loads(text)
    return r.status


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


# -- hypothesis: every route's schema -------------------------------------------------------------

NUM_EXAMPLES = 100  # per route
LONE = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800", "x\ud83d"])  # no valid pairs
TEXT = st.one_of(
    st.text(max_size=12),
    LONE,
    st.sampled_from(["", "\x00", "é中🙂", "<|im_end|>", "{{ raise_exception('x') }}", "x" * 300]),
)
HUGE = st.sampled_from([10**400, -(10**400), 10**400, 2**63, -(2**63) - 1, 10**30])
INT = st.one_of(st.integers(-3, 20), st.integers(), HUGE)
FLOAT = st.one_of(st.floats(), st.sampled_from([1e308, -1e308, 5e-324, -0.0]))
SCALAR = st.one_of(st.none(), st.booleans(), INT, FLOAT, TEXT)
ANY = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)


def schemas(odd: bool, wild: bool) -> dict:
    """Each route's body schema: {form: (required fields, optional fields)}, each a strategy; a
    form is a URL, "/tokenize messages" the other form of /tokenize.
    Valid: every value in range. Odd: a number may also be one no float holds, NaN or infinite,
    text hold lone surrogates, NUL or 300 characters, a token id lie past the vocabulary. Wild:
    odd, and any value may also be any JSON value at all."""
    text = TEXT if odd else st.text(min_size=1, max_size=12)  # hypothesis': no surrogates

    def f(plausible):
        return st.one_of(plausible, plausible, ANY) if wild else plausible

    def num(plausible):
        return f(st.one_of(plausible, plausible, HUGE, FLOAT) if odd else plausible)

    token_id = st.integers(0, 49151)
    if odd:
        token_id = st.one_of(token_id, token_id, st.integers(-2, 60000), HUGE)
    ids = st.lists(token_id, min_size=1, max_size=6)
    part = st.fixed_dictionaries({"type": f(st.just("text")), "text": f(text)})
    message = st.fixed_dictionaries(
        {
            "role": f(st.sampled_from(ROLES)),
            "content": f(st.one_of(text, st.lists(f(part), min_size=1, max_size=3))),
        },
        optional={"name": f(text)},
    )
    messages = f(st.lists(f(message), min_size=1, max_size=3))
    sampling = {
        "model": f(st.just(MODEL)),
        "n": num(st.integers(1, 3)),
        "stream": f(st.booleans()),
        "stream_options": ANY if wild else st.none(),  # only with stream: true
        "max_tokens": num(st.just(1)),
        "temperature": num(st.floats(0, 2)),
        "top_p": num(st.floats(0.01, 1)),
        "top_k": num(st.integers(-1, 100)),
        "min_p": num(st.floats(0, 1)),
        "presence_penalty": num(st.floats(-2, 2)),
        "frequency_penalty": num(st.floats(-2, 2)),
        "repetition_penalty": num(st.floats(0.5, 2)),
        "seed": num(st.integers(-(2**70), 2**70)),
        "min_tokens": num(st.integers(0, 1)),
        "ignore_eos": f(st.booleans()),
        "skip_special_tokens": f(st.booleans()),
        "stop": f(st.one_of(text, st.lists(text, max_size=4))),
        "stop_token_ids": f(st.lists(token_id, max_size=4)),
        "logit_bias": f(st.dictionaries(token_id.map(str), num(st.floats(-100, 100)), max_size=4)),
        "cache_salt": f(text),
        "user": f(text),
        "response_format": f(st.just({"type": "text"})),
        "tools": f(st.sampled_from([None, []])),
        "tool_choice": f(st.sampled_from([None, "none"])),
    }
    special = {"add_special_tokens": f(st.booleans())}
    return {
        "/v1/chat/completions": (
            {"messages": messages},
            sampling
            | {
                "max_completion_tokens": num(st.just(1)),
                "logprobs": f(st.booleans()),
                "top_logprobs": f(st.none()),
            },
        ),
        "/v1/completions": (
            {"prompt": f(st.one_of(text, ids, st.lists(st.one_of(text, ids), max_size=4)))},
            sampling
            | {
                "logprobs": num(st.integers(0, 5)),
                "echo": f(st.sampled_from([None, False])),
                "suffix": f(st.none()),
                "best_of": f(st.sampled_from([None, 1])),
            },
        ),
        "/tokenize": ({"prompt": f(text)}, special),
        "/tokenize messages": ({"messages": messages}, special),
        "/detokenize": ({"tokens": f(ids)}, {}),
        **new_api_schemas(f, num, text),
    }


def new_api_schemas(f, num, text) -> dict:
    """/v1/responses and /v1/messages (+ count_tokens): their own fields, then shared sampling."""
    tool = st.sampled_from([None, [], [{"type": "function", "name": "f"}]])
    part = st.fixed_dictionaries({"type": f(st.sampled_from(["input_text", "output_text"]))})
    content = f(st.one_of(text, st.lists(part.map(lambda p: p | {"text": "Hi"}), max_size=2)))
    said = st.fixed_dictionaries(
        {
            "role": f(st.sampled_from(["user", "assistant", "system", "developer"])),
            "content": content,
        },
        optional={"type": f(st.just("message"))},
    )
    item = st.one_of(
        said,
        said,
        said,
        st.fixed_dictionaries(
            {"type": f(st.sampled_from(["function_call", "function_call_output"]))},
            optional={"call_id": f(text), "name": f(text), "arguments": f(text), "output": f(text)},
        ),
        st.fixed_dictionaries({"type": f(st.just("reasoning")), "summary": f(st.just([]))}),
    )
    block = st.fixed_dictionaries(
        {"type": f(st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"]))},
        optional={
            "text": f(text),
            "id": f(text),
            "name": f(text),
            "input": f(st.just({})),
            "tool_use_id": f(text),
            "thinking": f(text),
        },
    )
    message = st.fixed_dictionaries(
        {
            "role": f(st.sampled_from(["user", "user", "assistant"])),
            "content": f(st.one_of(text, text, st.lists(f(block), min_size=1, max_size=3))),
        }
    )
    common = {
        "model": f(st.just(MODEL)),
        "temperature": num(st.floats(0, 1)),
        "top_p": num(st.floats(0.01, 1)),
        "stream": f(st.booleans()),
        "metadata": f(st.dictionaries(text, text, max_size=3)),
    }
    responses = common | {
        "max_output_tokens": num(st.just(1)),
        "instructions": f(text),
        "store": f(st.booleans()),
        "previous_response_id": f(st.none()),  # an unknown id is a 404: the mutations try it
        "tools": f(tool),
        "tool_choice": f(st.sampled_from([None, "none", "auto", "required"])),
        "parallel_tool_calls": f(st.booleans()),
        "text": f(st.sampled_from([None, {"format": {"type": "text"}}, {"format": {}}])),
        "reasoning": f(st.sampled_from([None, {"effort": "none"}, {"effort": "low"}, {}])),
    }
    thinking = [None, {"type": "disabled"}, {"type": "enabled", "budget_tokens": 1}]
    messages = common | {
        "system": f(st.one_of(text, st.just([{"type": "text", "text": "Be brief."}]))),
        "top_k": num(st.integers(-1, 100)),
        "stop_sequences": f(st.lists(text, max_size=4)),
        "thinking": f(st.sampled_from(thinking)),
        "tools": f(st.sampled_from([None, [], [{"name": "f", "input_schema": {}}]])),
        "tool_choice": f(st.sampled_from([None, {"type": "auto"}, {"type": "any"}])),
    }
    anthropic = f(st.lists(f(message), min_size=1, max_size=3))
    item_list = f(st.one_of(text, st.lists(f(item), min_size=1, max_size=3)))
    return {
        "/v1/responses": ({"input": item_list}, responses),
        "/v1/messages": ({"messages": anthropic, "max_tokens": num(st.just(2))}, messages),
        "/v1/messages/count_tokens": ({"messages": anthropic}, messages),
    }


def bodies(fields: tuple[dict, dict]):
    return st.fixed_dictionaries(fields[0], optional=fields[1])


def one_odd(valid: tuple[dict, dict], odd: tuple[dict, dict]):
    """A valid body but for one field, odd or wild: the checks before that field's pass. Half the
    time the field is a number, for the checks that convert numbers."""
    fields = {**odd[0], **odd[1]}
    numbers = [k for k in sorted(fields) if k in NUMBERS]
    keys = st.one_of(st.sampled_from(sorted(fields)), st.sampled_from(numbers or sorted(fields)))
    return keys.flatmap(
        lambda key: st.tuples(bodies(valid), st.one_of(fields[key], ANY, HUGE, FLOAT)).map(
            lambda t: {**t[0], key: t[1]}
        )
    )


NUMBERS = {
    "n",
    "max_output_tokens",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "best_of",
}


VALID, ODD, WILD = schemas(False, False), schemas(True, False), schemas(True, True)


def short(body):
    """Generation stops after a token or two: never up to the context limit."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and 1 < value < 10**6:
                body[key] = 1
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = 1
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 1
    return body


def route_bodies(url: str):
    """In 11 bodies: 3 valid, 4 valid but for one odd or wild field, 1 odd, 1 wild, 1 any JSON
    value, 1 raw bytes (broken JSON, NaN, deep nesting, 5000 digits)."""
    forms = [form for form in VALID if form.split()[0] == url]
    kinds = (
        [st.one_of([bodies(VALID[form]) for form in forms])] * 3
        + [st.one_of([one_odd(VALID[form], ODD[form]) for form in forms])] * 2
        + [st.one_of([one_odd(VALID[form], WILD[form]) for form in forms])] * 2
        + [st.one_of([bodies(ODD[form]) for form in forms])]
        + [st.one_of([bodies(WILD[form]) for form in forms])]
        + [ANY, st.sampled_from(RAW)]
    )
    return st.integers(0, len(kinds) - 1).flatmap(kinds.__getitem__)


def fuzz_route(loop, client, url: str, statuses: Counter):
    """Hypothesis' NUM_EXAMPLES bodies for `url`, each sent and checked on the running server."""

    @settings(
        max_examples=NUM_EXAMPLES,
        deadline=None,
        derandomize=True,  # the same bodies on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=route_bodies(url), coding=st.sampled_from(["identity"] * 4 + ["gzip", "cut-gzip"]))
    def one(body, coding):
        status = loop.run_until_complete(check(client, url, short(body), coding))
        statuses[url, status] += 1

    one()


def test_fuzz_every_route_schema_with_hypothesis(tiny_llm):
    engine = tiny_llm.engine
    loop = asyncio.new_event_loop()
    statuses: Counter = Counter()
    server = serving(engine)
    try:
        client = loop.run_until_complete(server.__aenter__())
        try:
            for url in BASE:
                fuzz_route(loop, client, url, statuses)
            loop.run_until_complete(wait_idle(engine))
            engine.check_invariants()
            health = loop.run_until_complete(client.get("/health"))
            assert health.status == 200
            loop.run_until_complete(health.release())
        finally:
            loop.run_until_complete(server.__aexit__(None, None, None))
    finally:
        loop.close()
    assert sum(statuses.values()) >= 4 * NUM_EXAMPLES, statuses
    for url in BASE:  # both paths exercised on every route
        assert statuses[url, 200] >= 20 and statuses[url, 400] >= 20, statuses
