"""Anthropic's /v1/messages through the official `anthropic` client, on the small thinking
checkpoint (thinking_helpers): plain, streamed (the SDK's accumulator, and every raw event
validated against its models), a tool round trip, with thinking, count_tokens, `x-api-key`, and
bad input: Anthropic-shaped 4xx, never a 500."""

from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from thinking_helpers import CALL, MODEL, TIME, forced, run_server, thinking_llm

EVENT = TypeAdapter(RawMessageStreamEvent)
TOOL = {"name": "get_time", "description": "The time", "input_schema": TIME}
ASK = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    return thinking_llm(tmp_path_factory, smollm2_path).engine


def client_of(client, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key, max_retries=0)


def strict(m: Message) -> Message:
    return Message.model_validate(m.to_dict())


def test_plain_streamed_and_thinking(engine):
    extra = forced("<think>ab</think>Noon.")

    async def go(client):
        c = client_of(client)
        plain = await c.messages.create(model=MODEL, max_tokens=4, messages=ASK, system="Be brief.")
        kw = dict(model=MODEL, max_tokens=80, messages=ASK, extra_body=extra)
        thinking = {"type": "enabled", "budget_tokens": 40}
        whole = await c.messages.create(**kw, thinking=thinking)
        events = [e async for e in await c.messages.create(**kw, thinking=thinking, stream=True)]
        async with c.messages.stream(**kw, thinking=thinking) as stream:
            final = await stream.get_final_message()
        await c.close()
        return strict(plain), strict(whole), events, strict(final)

    plain, whole, events, final = run_server(engine, go)
    assert plain.type == "message" and plain.role == "assistant" and plain.model == MODEL
    assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens <= 4
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert (whole.content[0].thinking, whole.content[1].text) == ("ab", "Noon.")
    assert whole.stop_reason == "end_turn" and whole.usage.output_tokens_details.thinking_tokens > 0
    for e in events:
        EVENT.validate_python(e.to_dict())
    kinds = [e.type for e in events]
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert compact == ["message_start", *block, *block, "message_delta", "message_stop"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=["thinking_delta", "text_delta"].index)
    assert final.content == whole.content and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_round_trip(engine):
    async def go(client):
        c = client_of(client)
        kw = dict(model=MODEL, max_tokens=250, tools=[TOOL])
        first = await c.messages.create(
            **kw, messages=ASK, tool_choice={"type": "tool", "name": "get_time"}
        )
        async with c.messages.stream(
            **kw, messages=ASK, extra_body=forced("<think>x</think>" + CALL)
        ) as stream:
            streamed = await stream.get_final_message()
        [use] = [b for b in first.content if b.type == "tool_use"]
        turn = [
            *ASK,
            {"role": "assistant", "content": [b.to_dict() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}],
            },
        ]
        second = await c.messages.create(**kw, messages=turn, extra_body=forced("It is noon."))
        count = await c.messages.count_tokens(model=MODEL, messages=turn, tools=[TOOL])
        await c.close()
        return strict(first), strict(streamed), strict(second), count

    first, streamed, second, count = run_server(engine, go)
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_time" and use.id.startswith("toolu_")
    assert set(use.input) == {"zone"}
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[1].input == {"zone": "CET"} and streamed.stop_reason == "tool_use"
    assert second.content[0].text == "It is noon." and second.stop_reason == "end_turn"
    cached = second.usage.cache_read_input_tokens
    assert cached >= 16  # the second turn reuses the first turn's prompt (prefix caching)
    assert count.input_tokens == second.usage.input_tokens + cached


def test_thinking_budget_is_exact(engine):
    """thinking.budget_tokens is enforced: after a prompt that opened <think>, this random model
    thinks for exactly the budget, the engine forces </think>, and the answer follows."""
    end_ids = engine.tokenizer.encode("</think>", add_special_tokens=False)

    async def go(client):
        c = client_of(client)
        m = await c.messages.create(
            model=MODEL,
            max_tokens=30,
            messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 6},
            extra_body={"chat_template_kwargs": {"think_in_prompt": True}, "temperature": 0},
        )
        await c.close()
        return strict(m)

    m = run_server(engine, go)
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens_details.thinking_tokens == 6 + len(end_ids)


def test_count_tokens_thinking_off_and_prefill(engine):
    tok = engine.tokenizer

    async def go(client):
        c = client_of(client)
        on = await c.messages.count_tokens(model=MODEL, messages=ASK)
        off = await c.messages.count_tokens(
            model=MODEL, messages=ASK, thinking={"type": "disabled"}
        )
        prefill = await c.messages.create(
            model=MODEL,
            max_tokens=40,
            messages=[*ASK, {"role": "assistant", "content": "It is"}],
            extra_body=forced(" noon."),
        )
        await c.close()
        return on, off, prefill

    on, off, prefill = run_server(engine, go)
    assert on.input_tokens == len(
        tok.encode(tok.apply_chat_template(ASK), add_special_tokens=False)
    )
    text = tok.apply_chat_template(ASK, enable_thinking=False)
    assert off.input_tokens == len(tok.encode(text, add_special_tokens=False))
    assert prefill.content[0].text == " noon."  # the model continued the assistant's text


def test_x_api_key(engine):
    async def go(client):
        good, bad = client_of(client, "sekret"), client_of(client, "wrong")
        r = await good.messages.create(model=MODEL, max_tokens=1, messages=ASK)
        with pytest.raises(anthropic.AuthenticationError) as e:
            await bad.messages.create(model=MODEL, max_tokens=1, messages=ASK)
        await good.close(), await bad.close()
        return r, e.value.body

    r, body = run_server(engine, go, api_key="sekret")
    assert r.type == "message"
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


BAD = [  # (body, status)
    ({"messages": ASK}, 400),  # no max_tokens
    ({"messages": ASK, "max_tokens": 0}, 400),
    ({"messages": [], "max_tokens": 1}, 400),
    (
        {
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}
            ],
        },
        400,
    ),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
    ({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}, 400),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": "x" * 400_000}]}, 400),
    ({"max_tokens": 1, "messages": ASK, "tools": [{"type": "web_search_20250305"}]}, 400),
    ({"max_tokens": 1, "messages": ASK, "tool_choice": {"type": "sometimes"}}, 400),
    ({"max_tokens": 9, "messages": ASK, "thinking": {"type": "enabled"}}, 400),
    ({"max_tokens": 9, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 9}}, 400),
    ({"max_tokens": 1, "messages": ASK, "temperature": "hot"}, 400),
    ({"max_tokens": 1, "messages": ASK, "model": "claude-opus-9"}, 404),
    ("not an object", 400),
]


def test_bad_input_gets_anthropic_shaped_4xx(engine):
    async def go(client):
        out = []
        for body, _ in BAD:
            for path in ("/v1/messages", "/v1/messages/count_tokens"):
                r = await client.post(path, json=body)
                text = await r.text()
                assert r.status < 500, text
                if r.status >= 400:  # count_tokens needs no max_tokens
                    err = json.loads(text)
                    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
                    assert "Traceback" not in text and ".py" not in text
                if path == "/v1/messages":
                    out.append(r.status)
        r = await client.post(
            "/v1/messages", data=b"{", headers={"Content-Type": "application/json"}
        )
        out.append((r.status, (await r.json())["error"]["type"]))
        return out

    got = run_server(engine, go)
    assert got == [s for _, s in BAD] + [(400, "invalid_request_error")]
