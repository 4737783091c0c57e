"""/v1/responses through the official `openai` client, on the small thinking checkpoint
(thinking_helpers): plain, streamed (every event validated against the client's own models, in
the documented order), a function-tool round trip, previous_response_id (prefix cache reused across
turns, scoped to the API key), GET / DELETE, and bad input: OpenAI-shaped 4xx, never a 500."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from thinking_helpers import CALL, MODEL, TIME, forced, run_server, thinking_llm

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    return thinking_llm(tmp_path_factory, smollm2_path).engine


def client_of(client, key: str = "key-a") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


def strict(r: Response) -> Response:
    """The body re-validated by the client's pydantic model (construct() checks nothing)."""
    return Response.model_validate(r.to_dict())


def test_plain_and_with_reasoning(engine):
    async def go(client):
        c = client_of(client)
        plain = await c.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
        thought = await c.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            max_output_tokens=80,
            extra_body=forced("<think>ab</think>Hello there"),
        )
        await c.close()
        return strict(plain), strict(thought)

    plain, thought = run_server(engine, go)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.status in ("completed", "incomplete") and plain.model == MODEL
    assert plain.usage.output_tokens <= 4 and plain.usage.input_tokens > 0
    if plain.status == "incomplete":
        assert plain.incomplete_details.reason == "max_output_tokens"
    assert thought.status == "completed" and thought.instructions == "Be brief."
    reasoning, message = thought.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "ab"
    assert message.type == "message" and thought.output_text == "Hello there"
    assert 0 < thought.usage.output_tokens_details.reasoning_tokens < thought.usage.output_tokens


def test_reasoning_effort_sets_the_budget(engine):
    """reasoning.effort "minimal" is a 256-token budget: then </think> is forced, the answer
    follows."""
    end_ids = engine.tokenizer.encode("</think>", add_special_tokens=False)

    async def go(client):
        c = client_of(client)
        r = await c.responses.create(
            model=MODEL,
            input="What time is it?",
            max_output_tokens=300,
            temperature=0,
            reasoning={"effort": "minimal"},
            extra_body={"chat_template_kwargs": {"think_in_prompt": True}},
        )
        await c.close()
        return strict(r)

    r = run_server(engine, go)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 256 + len(end_ids)


def test_streamed_events_in_order(engine):
    async def go(client):
        c = client_of(client)
        kw = dict(model=MODEL, input="Hi", max_output_tokens=80)
        extra = forced("<think>ab</think>Hello there")
        events = [e async for e in await c.responses.create(**kw, stream=True, extra_body=extra)]
        async with c.responses.stream(**kw, extra_body=extra) as stream:  # the SDK's accumulator
            final = await stream.get_final_response()
        whole = await c.responses.create(**kw, extra_body=extra)
        await c.close()
        return events, final, whole

    events, final, whole = run_server(engine, go)
    for e in events:
        EVENT.validate_python(e.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # deltas merged
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert compact == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        *done,
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        *done,
        "response.completed",
    ]
    completed = events[-1].response
    assert completed.output_text == final.output_text == whole.output_text == "Hello there"
    assert completed.output[0].content[0].text == "ab"
    assert completed.usage == whole.usage


def test_function_tool_round_trip(engine):
    async def go(client):
        c = client_of(client)
        kw = dict(model=MODEL, tools=[TOOL], max_output_tokens=250)
        first = await c.responses.create(
            **kw, input="Time?", tool_choice="required", parallel_tool_calls=False
        )
        events = [
            e
            async for e in await c.responses.create(
                **kw, input="Time?", stream=True, extra_body=forced("<think>x</think>" + CALL)
            )
        ]
        [call] = [o for o in first.output if o.type == "function_call"]
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}
        # the whole conversation sent back, and the same through previous_response_id
        second = await c.responses.create(
            **kw, input=[{"role": "user", "content": "Time?"}, call.to_dict(), answer]
        )
        chained = await c.responses.create(**kw, previous_response_id=first.id, input=[answer])
        await c.close()
        return strict(first), events, strict(second), strict(chained)

    first, events, second, chained = run_server(engine, go)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_time" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"zone"} and call.call_id.startswith("call_")
    for e in events:
        EVENT.validate_python(e.to_dict())
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"zone": "CET"}
    assert [o.type for o in events[-1].response.output] == ["reasoning", "function_call"]
    assert second.status in ("completed", "incomplete")
    assert chained.status in ("completed", "incomplete")
    # the stored turn renders as the conversation sent in full
    assert chained.usage.input_tokens == second.usage.input_tokens


def test_previous_response_id_store_get_delete(engine):
    async def go(client):
        a, b = client_of(client, "key-a"), client_of(client, "key-b")
        story = "My name is Ada. " * 12  # a few full KV blocks: the next turn reuses them
        first = await a.responses.create(model=MODEL, input=story, max_output_tokens=3)
        second = await a.responses.create(
            model=MODEL, previous_response_id=first.id, input="My name?", max_output_tokens=3
        )
        got = await a.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):  # another key sees no such response
            await b.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model=MODEL, previous_response_id=first.id, input="x")
        unstored = await a.responses.create(
            model=MODEL, input="x", max_output_tokens=1, store=False
        )
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(unstored.id)
        await a.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(first.id)
        await a.close(), await b.close()
        return first, second, got

    first, second, got = run_server(engine, go)
    assert got.id == first.id and got.output_text == first.output_text
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # prefix caching across turns


BAD = [  # (body, status, param)
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]}, 400, "tools"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "input"),
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": "x" * 400_000}, 400, "input"),  # past the context
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text.format"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "model": "gpt-5"}, 404, "model"),
    ([1, 2], 400, None),
]


def test_bad_input_gets_openai_shaped_4xx(engine):
    async def go(client):
        out = []
        for body, _, _ in BAD:
            if isinstance(body, dict):  # short, unless the body sets its own
                body = {"max_output_tokens": 2} | body
            r = await client.post("/v1/responses", json=body)
            text = await r.text()
            err = json.loads(text)["error"]
            assert set(err) == {"message", "type", "param", "code"}, text
            assert "Traceback" not in text and ".py" not in text
            out.append((r.status, err["param"]))
        for method in (client.get, client.delete):
            r = await method("/v1/responses/resp_unknown")
            out.append((r.status, (await r.json())["error"]["code"]))
        return out

    got = run_server(engine, go)
    assert got == [(s, p) for _, s, p in BAD] + [(404, "not_found")] * 2
