"""Structured outputs through the API, with the `openai` client against a live server on the real
SmolLM2: response_format json_schema (sampled at temperature 1, n=2, streamed and not) and
json_object, vLLM's structured_outputs {regex, choice, grammar, json} and guided_* names on both
endpoints; bad specs are OpenAI-shaped 400s naming the field, before anything is queued; the
grammar compiles off the event loop, once per spec."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import openai
import pytest
from test_server import serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "happy"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person called Ann as JSON."}]
ARITH = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]{1,3}\n'


@pytest.fixture(scope="module")
def engine(smollm2_llm):
    return smollm2_llm.engine


def valid(x, schema: dict) -> bool:
    """The JSON Schema subset used here (jsonschema is not a dependency)."""
    if "enum" in schema:
        return x in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True) is False and not set(x) <= set(props)
        return (
            isinstance(x, dict)
            and not extra
            and set(schema.get("required", [])) <= set(x)
            and all(valid(v, props[k]) for k, v in x.items() if k in props)
        )
    if kind == "string":
        return isinstance(x, str) and len(x) <= schema.get("maxLength", len(x))
    if kind == "integer":
        low, high = schema.get("minimum", x), schema.get("maximum", x)
        return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high
    if kind == "boolean":
        return isinstance(x, bool)
    raise AssertionError(f"unhandled schema {schema}")


def run(engine, fn):
    """fn(openai client, aiohttp test client) on a live server; returns its result."""

    async def go():
        async with serving(engine) as client:
            c = openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0
            )
            try:
                return await fn(c, client)
            finally:
                await c.close()

    return asyncio.run(go())


async def streamed_texts(stream) -> tuple[dict[int, str], dict[int, str]]:
    """(text, finish_reason) per choice index of a chat or completions stream."""
    texts, finish = {}, {}
    async for chunk in stream:
        for ch in chunk.choices:
            piece = ch.delta.content if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    return texts, finish


def test_json_schema_sampled_n2_streamed_and_not(engine):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    kw = dict(model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, n=2, max_tokens=120)

    async def go(c, _):
        whole = await c.chat.completions.create(**kw, seed=1)
        streamed = await streamed_texts(await c.chat.completions.create(**kw, seed=2, stream=True))
        return whole, streamed

    whole, (texts, finish) = run(engine, go)
    outs = [(ch.message.content, ch.finish_reason) for ch in whole.choices]
    outs += [(texts[i], finish[i]) for i in sorted(texts)]
    assert len(outs) == 4
    for text, reason in outs:
        assert reason == "stop", (text, reason)  # the grammar completed, then EOS
        assert valid(json.loads(text), PERSON), text


def test_json_object_and_pydantic_parse(engine):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    async def go(c, _):
        obj = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Give me a JSON object about Paris."}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=60,
        )
        parsed = await c.chat.completions.parse(  # the client's own strict json_schema path
            model=MODEL,
            messages=[{"role": "user", "content": "Which city is the capital of France?"}],
            response_format=City,
            temperature=0,
            max_tokens=40,
        )
        return obj, parsed

    obj, parsed = run(engine, go)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut at max_tokens: still an object's prefix
        assert obj.choices[0].message.content.lstrip().startswith("{")
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, City)


def test_vllm_kinds_on_both_endpoints(engine):
    phone = r"\(0[1-9]\) [0-9]{2}( [0-9]{2}){3}"
    choices = ["yes", "no"]
    question = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]

    async def go(c, _):
        out = {}
        chat = c.chat.completions.create
        out["regex"] = await chat(
            model=MODEL,
            messages=[{"role": "user", "content": "A French phone number, please."}],
            extra_body={"structured_outputs": {"regex": phone}},
            temperature=1.0,
            seed=3,
            max_tokens=30,
        )
        out["choice"] = await chat(
            model=MODEL,
            messages=question,
            extra_body={"structured_outputs": {"choice": choices}},
            temperature=1.0,
            n=3,
            seed=4,
            max_tokens=5,
        )
        out["grammar"] = await streamed_texts(
            await chat(
                model=MODEL,
                messages=[{"role": "user", "content": "Write a sum of two numbers."}],
                extra_body={"structured_outputs": {"grammar": ARITH}},
                temperature=1.0,
                seed=5,
                max_tokens=20,
                stream=True,
            )
        )
        out["guided_choice"] = await chat(
            model=MODEL, messages=question, extra_body={"guided_choice": choices}, max_tokens=5
        )
        completions = c.completions.create
        out["completions_regex"] = await completions(
            model=MODEL,
            prompt="My phone number is ",
            extra_body={"guided_regex": phone},
            temperature=1.0,
            n=2,
            max_tokens=30,
        )
        out["completions_json"] = await streamed_texts(
            await completions(
                model=MODEL,
                prompt="A person as JSON: ",
                extra_body={"structured_outputs": {"json": PERSON}},
                temperature=1.0,
                seed=6,
                max_tokens=120,
                stream=True,
            )
        )
        return out

    out = run(engine, go)
    assert re.fullmatch(phone, out["regex"].choices[0].message.content)
    assert len(out["choice"].choices) == 3
    assert all(ch.message.content in choices for ch in out["choice"].choices)
    assert out["guided_choice"].choices[0].message.content in choices
    texts, finish = out["grammar"]
    if finish[0] == "stop":
        assert re.fullmatch(r"[0-9]{1,3}([+-][0-9]{1,3})*", texts[0]), texts
    for ch in out["completions_regex"].choices:
        assert ch.finish_reason == "stop" and re.fullmatch(phone, ch.text), ch.text
    texts, finish = out["completions_json"]
    assert finish[0] == "stop" and valid(json.loads(texts[0]), PERSON), texts


CHAT_BODY = {"model": MODEL, "messages": ASK, "max_tokens": 5}
SCHEMA_FMT = {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON}}
BAD = [  # (body fields, param)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format",
    ),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format",
    ),
    (
        {
            "response_format": SCHEMA_FMT
            | {"json_schema": {"name": "x", "schema": PERSON, "strict": 1}}
        },
        "response_format",
    ),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"response_format": SCHEMA_FMT, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": SCHEMA_FMT, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": [1, 2]}, "guided_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    # rejected by xgrammar: compiled before anything is queued
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format",
    ),
    ({"structured_outputs": {"json": {"type": "object", "properties": 5}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "guided_json"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
]


def test_bad_specs_are_400s_before_anything_is_queued(engine):
    compiles = engine.grammar_compiler

    async def go(c, client):
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL,
                messages=ASK,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            )
        errors = [e.value.body]
        for fields, param in BAD:
            for url in ("/v1/chat/completions", "/v1/completions"):
                body = CHAT_BODY | fields
                if url == "/v1/completions":
                    body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "Hi"}
                r = await client.post(url, json=body)
                text = await r.text()
                assert r.status == 400, (fields, text)
                err = json.loads(text)["error"]
                assert err["param"] == param, (fields, err)
                assert "Traceback" not in text and ".cc" not in text and ".py" not in text, text
                errors.append(err)
                assert not engine.has_unfinished() and not engine.requests  # nothing queued
        return errors

    num_compiles = compiles.num_compiles
    errors = run(engine, go)
    assert errors[0]["param"] == "response_format" and "nope" in errors[0]["message"]
    assert compiles.num_compiles == num_compiles  # no invalid spec was cached


def test_compiles_off_the_loop_once_per_spec(engine, monkeypatch):
    compiler = engine.grammar_compiler
    threads = []
    compile_ = compiler.compile

    def spy(spec):
        threads.append(threading.current_thread())
        return compile_(spec)

    monkeypatch.setattr(compiler, "compile", spy)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9, "minimum": 0}},
    }
    body = dict(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=20,
        temperature=0,
    )

    async def go(c, _):
        loop_thread = threading.current_thread()
        before = (compiler.num_compiles, compiler.num_cache_hits)
        first = await c.chat.completions.create(**body)
        second = await c.chat.completions.create(**body)
        return loop_thread, before, first, second

    loop_thread, before, first, second = run(engine, go)
    assert first.choices[0].message.content == second.choices[0].message.content
    assert valid(json.loads(first.choices[0].message.content), schema)
    assert threads and loop_thread not in threads  # every compile ran in an executor thread
    assert compiler.num_compiles == before[0] + 1  # compiled once, then cache hits
    assert compiler.num_cache_hits >= before[1] + 3  # the engine's own lookups, the 2nd request
