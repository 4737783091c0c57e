"""Reasoning split (`--reasoning-parser`): the parser on fixed text (`</think>` split at every
place, Qwen3 / Qwen3.5 / DeepSeek-R1 starts), and chat against a live server on a small checkpoint
whose template thinks: message.reasoning (+ reasoning_content), reasoning deltas before content,
reasoning_tokens, reasoning cut by max_tokens, thinking switched off by chat_template_kwargs, tool
calls read from the answer only."""

from __future__ import annotations

import json

import openai
import pytest
from thinking_helpers import CALL, MODEL, TIME_TOOL, forced, run_server, thinking_llm

from tinyserve import SamplingParams
from tinyserve.sampling_params import StructuredOutputsParams as SO
from tinyserve.serve.chat_template import render_chat
from tinyserve.serve.reasoning import (
    ANSWER,
    EITHER,
    REASONING,
    ReasoningParser,
    effort_budget,
    num_reasoning_tokens,
    output_start,
    reasoning_params,
)

ASK = [{"role": "user", "content": "What time is it?"}]


# -- the parser on fixed text ---------------------------------------------------------------------


def split(start: str, text: str, size: int) -> tuple[str, str]:
    parser, reasoning, answer = ReasoningParser(start), "", ""
    for i in range(0, len(text), size):
        r, a = parser.feed(text[i : i + size])
        reasoning, answer = reasoning + r, answer + a
    r, a = parser.feed("", final=True)
    return reasoning + r, answer + a


@pytest.mark.parametrize(
    "start,text,want",
    [
        (
            EITHER,
            "<think>\nLet me think.\n</think>\n\nIt is noon.",
            ("\nLet me think.\n", "It is noon."),
        ),
        (EITHER, "  <think>a</think>b", ("a", "b")),
        (EITHER, "It is noon.", ("", "It is noon.")),  # Qwen3 that did not think
        (EITHER, "<thin", ("", "<thin")),  # not the tag after all
        (REASONING, "a < b </thin then</think>b", ("a < b </thin then", "b")),  # Qwen3.5
        (REASONING, "<think>a</think>b", ("a", "b")),  # a repeated opening tag is dropped
        (REASONING, "cut short by max_tokens", ("cut short by max_tokens", "")),
        (ANSWER, "<think>a</think>b", ("", "<think>a</think>b")),  # thinking switched off
    ],
)
def test_parser_whole_and_in_every_split(start, text, want):
    for size in range(1, len(text) + 1):  # size 8 puts "</think>" across two pieces, and so on
        assert split(start, text, size) == want, size


def test_close_tag_across_two_pieces():
    p = ReasoningParser(REASONING)
    assert p.feed("abc</thi") == ("abc", "")  # "</thi" held: it may be the tag forming
    assert p.feed("nk>\n\nanswer") == ("", "answer")
    p = ReasoningParser(REASONING)
    assert p.feed("abc</thi") == ("abc", "")
    assert p.feed("ng>") == ("</thing>", "")  # it was not


def test_output_start_from_the_prompt():
    assert output_start(None, "<think>\n") is None  # no parser: all answer
    assert output_start("qwen3", "<|im_start|>assistant\n") == EITHER
    assert output_start("qwen3", "<|im_start|>assistant\n<think>\n") == REASONING
    assert output_start("qwen3", "assistant\n<think>\n\n</think>\n\n") == ANSWER
    assert output_start("deepseek_r1", "<｜Assistant｜>") == REASONING  # R1 may omit <think>
    assert output_start("deepseek_r1", "<｜Assistant｜><think>\n\n</think>") == ANSWER


# -- the live server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    return thinking_llm(tmp_path_factory, smollm2_path).engine


def test_reasoning_tokens_count_the_split_close_tag(engine):
    tok = engine.tokenizer
    ids = tok.encode("<think>ab</think>Hi", add_special_tokens=False)
    head = tok.encode("<think>ab</think>", add_special_tokens=False)
    assert len(tok.encode("</think>", add_special_tokens=False)) >= 2  # split across tokens
    assert num_reasoning_tokens(tok, ids, True) == len(head)
    assert num_reasoning_tokens(tok, ids, False) == 0


async def chat(client, stream=False, **kw):
    c = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    body = dict(model=MODEL, messages=ASK, max_tokens=60) | kw
    try:
        if not stream:
            return await c.chat.completions.create(**body)
        chunks = [ch async for ch in await c.chat.completions.create(**body, stream=True)]
        return chunks
    finally:
        await c.close()


def streamed(chunks) -> tuple[list[str], str, str, str | None]:
    """(the kinds of deltas in order, reasoning, content, finish_reason)."""
    kinds, reasoning, content, finish = [], "", "", None
    for ch in chunks:
        for choice in ch.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                assert extra["reasoning_content"] == extra["reasoning"]
                kinds.append("reasoning")
                reasoning += extra["reasoning"]
            if choice.delta.content:
                kinds.append("content")
                content += choice.delta.content
            finish = choice.finish_reason or finish
    return kinds, reasoning, content, finish


def test_chat_reasoning_whole_and_streamed(engine):
    extra = forced("<think>\nab cd</think>\n\nIt is noon.")

    async def go(client):
        return (
            await chat(client, extra_body=extra),
            await chat(
                client, stream=True, extra_body=extra, stream_options={"include_usage": True}
            ),
        )

    whole, chunks = run_server(engine, go)
    message = whole.choices[0].message
    assert (message.reasoning, message.reasoning_content) == ("\nab cd", "\nab cd")
    assert message.content == "It is noon." and whole.choices[0].finish_reason == "stop"
    num = whole.usage.completion_tokens_details.reasoning_tokens
    assert 3 <= num < whole.usage.completion_tokens  # the tags' tokens and the reasoning's
    kinds, reasoning, content, finish = streamed(chunks)
    assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # reasoning first
    assert len([k for k in kinds if k == "reasoning"]) >= 2  # it streamed, token by token
    assert (reasoning, content, finish) == ("\nab cd", "It is noon.", "stop")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == num


def test_reasoning_cut_by_max_tokens(engine):
    extra = forced("<think>" + "thinking " * 20 + "</think>Done")

    async def go(client):
        return (
            await chat(client, extra_body=extra, max_tokens=6),
            await chat(client, stream=True, extra_body=extra, max_tokens=6),
        )

    whole, chunks = run_server(engine, go)
    ch = whole.choices[0]
    assert ch.finish_reason == "length" and ch.message.content is None
    assert ch.message.reasoning.startswith("thinking")
    assert whole.usage.completion_tokens_details.reasoning_tokens == 6
    kinds, reasoning, content, finish = streamed(chunks)
    assert set(kinds) == {"reasoning"} and content == "" and finish == "length"
    assert reasoning == ch.message.reasoning


def test_thinking_switched_off_or_opened_by_the_template(engine):
    tok = engine.tokenizer
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    opened = {"chat_template_kwargs": {"think_in_prompt": True}}

    async def go(client):
        return (
            await chat(client, extra_body=forced("<think>a</think>b") | off),
            await chat(client, extra_body=forced("ab</think>\n\ncd") | opened),
        )

    disabled, qwen35 = run_server(engine, go)
    text = tok.apply_chat_template(ASK, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")  # the kwarg reached the template
    assert disabled.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    message = disabled.choices[0].message
    assert (message.reasoning, message.content) == (None, "<think>a</think>b")  # all answer
    assert disabled.usage.completion_tokens_details.reasoning_tokens == 0
    message = qwen35.choices[0].message  # the prompt opened <think>: the output starts inside
    assert (message.reasoning, message.content) == ("ab", "cd")


def test_tool_calls_come_from_the_answer_only(engine):
    after = forced("<think>check the clock</think>\n" + CALL)
    inside = forced("<think>maybe " + CALL + "</think>No call.")

    async def go(client):
        kw = dict(tools=[TIME_TOOL], tool_choice="auto", max_tokens=250)
        return (
            await chat(client, extra_body=after, **kw),
            await chat(client, stream=True, extra_body=after, **kw),
            await chat(client, extra_body=inside, **kw),
        )

    whole, chunks, inside_ = run_server(engine, go)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert ch.message.reasoning == "check the clock"
    [call] = ch.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "CET"},
    )
    kinds, reasoning, content, finish = streamed(chunks)
    assert (reasoning, content, finish) == ("check the clock", "", "tool_calls")
    args = "".join(
        d.function.arguments or ""
        for c in chunks
        for x in c.choices
        for d in x.delta.tool_calls or []
    )
    assert json.loads(args) == {"zone": "CET"}
    ch = inside_.choices[0]  # a call written inside the reasoning is no call
    assert ch.message.tool_calls is None and ch.message.content == "No call."
    assert ch.finish_reason == "stop" and CALL in ch.message.reasoning


def test_no_parser_leaves_the_text_alone(engine):
    async def go(client):
        return await chat(client, extra_body=forced("<think>a</think>b"))

    r = run_server(engine, go, reasoning_parser=None)
    assert r.choices[0].message.content == "<think>a</think>b"
    assert (r.choices[0].message.model_extra or {}).get("reasoning") is None
    assert r.usage.completion_tokens_details is None


def test_bad_chat_template_kwargs_are_400s(engine):
    async def go(client):
        out = []
        for kwargs in [[1], {"messages": []}, {"add_generation_prompt": False}, {"a b": 1}]:
            body = {"messages": ASK, "max_tokens": 1, "chat_template_kwargs": kwargs}
            r = await client.post("/v1/chat/completions", json=body)
            out.append((r.status, (await r.json())["error"]["param"]))
        return out

    assert run_server(engine, go) == [(400, "chat_template_kwargs")] * 4


def test_forced_call_after_an_opened_think_follows_the_reasoning(engine):
    """After a prompt that opened <think>, a forced call's grammar applies once the reasoning
    ended: thinking_token_budget (vLLM's) makes this random model end it, the call follows."""
    named = {"type": "function", "function": {"name": "get_time"}}
    opened = {
        "chat_template_kwargs": {"think_in_prompt": True},
        "temperature": 0,
        "thinking_token_budget": 5,
    }

    async def go(client):
        kw = dict(tools=[TIME_TOOL], tool_choice=named, max_tokens=250, extra_body=opened)
        return await chat(client, **kw)

    ch = run_server(engine, go).choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    assert ch.message.reasoning and ch.message.content is None


def test_thinking_token_budget_is_checked(engine):
    async def go(client):
        for bad_budget in (-1, 1.5, "3", True):
            with pytest.raises(openai.BadRequestError) as e:
                await chat(client, max_tokens=4, extra_body={"thinking_token_budget": bad_budget})
            assert e.value.body["param"] == "thinking_token_budget"

    run_server(engine, go)


# -- the reasoning budget and grammars after the reasoning: the mapping, run by the engine --------


def test_effort_budgets():
    assert [effort_budget(e, None) for e in ("minimal", "low", "medium", "high")] == [
        256,
        1024,
        4096,
        16384,
    ]
    assert effort_budget("high", 100) == 99  # capped by max_tokens
    assert effort_budget(None, 100) is effort_budget("xhigh", 100) is None


def test_reasoning_params_by_start_and_grammar(engine):
    tok = engine.tokenizer
    close = tok.encode("</think>", add_special_tokens=False)
    regex, schema = SO(regex="a"), SO(json={"type": "object"})
    assert reasoning_params(tok, None, 9, None) == (None, None)  # no parser
    assert reasoning_params(tok, ANSWER, 9, schema) == (ANSWER, None)  # thinking off
    assert reasoning_params(tok, REASONING, None, None) == (REASONING, None)  # nothing to do
    assert reasoning_params(tok, REASONING, 9, regex) == (REASONING, None)  # it spells the tags
    start, spec = reasoning_params(tok, REASONING, 9, None)
    assert (start, spec.end_ids, spec.budget, spec.starts_in_reasoning) == (
        REASONING,
        close,
        9,
        True,
    )
    start, spec = reasoning_params(tok, REASONING, None, schema)  # the grammar after </think>
    assert start == REASONING and spec.budget is None and spec.starts_in_reasoning
    assert reasoning_params(tok, EITHER, 9, schema) == (ANSWER, None)  # as before: all answer
    start, spec = reasoning_params(tok, EITHER, 9, None, forced_tool=False)
    assert not spec.starts_in_reasoning
    assert spec.start_ids == tok.encode("<think>", add_special_tokens=False)


def run_engine(engine, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("budget", prompt_ids, params)
    ids = []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.outputs[0].token_ids
    engine.check_invariants()
    return ids


@pytest.mark.parametrize("start_opened", [True, False])
def test_budget_then_json_after_the_reasoning(engine, start_opened):
    """A rendered prompt that opens <think>, a budget of 6 and a JSON schema: exactly 6 reasoning
    tokens (unmasked), the `</think>` the engine forced, then an answer that is the schema's.
    When the model may open the reasoning itself, the schema holds from the first token."""
    tok = engine.tokenizer
    options = {"add_generation_prompt": True, "think_in_prompt": start_opened}
    ids, text = render_chat(tok, ASK, None, options)
    start = output_start("qwen3", text)
    assert start == (REASONING if start_opened else EITHER)
    ok = {"type": "object", "properties": {"ok": {"enum": [1, 2]}}, "required": ["ok"]}
    schema = SO(json=ok | {"additionalProperties": False}, disable_any_whitespace=True)
    start, spec = reasoning_params(tok, start, 6, schema)
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, reasoning=spec, structured_outputs=schema
    )
    out = run_engine(engine, ids, params)
    parser = ReasoningParser(start)
    reasoning, answer = parser.feed(tok.decode(out), final=True)
    assert json.loads(answer) in ({"ok": 1}, {"ok": 2})
    if start_opened:  # 6 noise tokens, then the end the engine forced
        close = tok.encode("</think>", add_special_tokens=False)
        assert out[6 : 6 + len(close)] == close
        assert num_reasoning_tokens(tok, out, True) == 6 + len(close)
        assert reasoning == tok.decode(out[:6])
    else:  # the model may not open a reasoning: the grammar holds from the first token
        assert start == ANSWER and reasoning == ""
