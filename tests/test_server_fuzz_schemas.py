"""Fuzz with hypothesis over every POST route's body schema: every field either plausible or any
JSON value (wrong types, NaN, integers no float holds, lone surrogates), some gzipped, whole or
cut short. Never a 5xx, the route's error shape on a 4xx, complete streams on a 200, the engine's
invariants and /health afterwards (fuzz_helpers.check).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from fuzz_helpers import BASE, MODEL, RAW, check, make_tiny_llm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import serving, wait_idle

from tinyserve.serve.fields import ROLES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llm(smollm2_path, tmp_path_factory):
    return make_tiny_llm(smollm2_path, tmp_path_factory)


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
