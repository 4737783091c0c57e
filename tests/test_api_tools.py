"""Tool calling: the parser on fixed text (Hermes / Qwen and Llama 3 forms, whole and streamed in
pieces, malformed input), request validation, and the `openai` client against a live server on a
tiny random Llama with SmolLM2's tokenizer and a Hermes (Qwen 2.5 style) or Llama 3 style chat
template: `required` / named choices force calls whose arguments match the tool's schema
(streamed and not, n=2 at temperature 1), tool history renders through the template, `none`."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
from test_server import serving

from tinyserve import LLM
from tinyserve.serve.tool_parser import HERMES, LLAMA3, ToolParser, extract_tool_calls, merge_deltas
from tinyserve.serve.tools import tool_form

HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}You are helpful.{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools>:' }}
{{- '\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
    or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# Llama 3.1's way: tools in the user turn, calls as {"name": ..., "parameters": ...}.
LLAMA3_TEMPLATE = """
{%- for message in messages %}
{%- if message.role == 'user' and tools %}
{{- '<|im_start|>user\\nRespond with a JSON {"name": function name, "parameters": arguments} ' }}
{{- 'for a function call. Functions:\\n' }}
{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
{{- message.content + '<|im_end|>\\n' }}
{%- elif message.tool_calls %}
{{- '<|im_start|>assistant\\n' }}
{%- for tool_call in message.tool_calls %}
{{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
{{- tool_call.function.arguments | tojson + '}' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
TINY = dict(  # a random Llama over SmolLM2's vocabulary: fast, and its output is noise
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    torch_dtype="float32",
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
MODEL = "tiny"


# -- the parser on fixed text ---------------------------------------------------------------------

HERMES_TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c", "days": 3}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
LLAMA3_TEXT = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f", "days": 1}}'
    '; {"name": "get_time", "parameters": {"zone": "}{\\""}}'
)


def streamed(form: str, text: str, size: int) -> tuple[str, list[dict], list[dict]]:
    parser, content, deltas = ToolParser(form), "", []
    for i in range(0, len(text), size):
        piece, calls = parser.feed(text[i : i + size])
        content, deltas = content + piece, deltas + calls
    piece, calls = parser.feed("", final=True)
    return content + piece, merge_deltas(deltas + calls), deltas + calls


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 7, 10_000])
def test_parser_whole_and_streamed(size):
    for form, text, content, want in [
        (
            HERMES,
            HERMES_TEXT,
            "Let me check.",
            [
                ("get_weather", {"city": "Paris", "unit": "c", "days": 3}),
                ("get_time", {"zone": "CET"}),
            ],
        ),
        (
            LLAMA3,
            LLAMA3_TEXT,
            None,
            [
                ("get_weather", {"city": "Rome", "unit": "f", "days": 1}),
                ("get_time", {"zone": '}{"'}),
            ],
        ),
        (
            HERMES,
            '<tool_call>{"arguments": {"a": [1, "]"]}, "name": "f"}',
            None,
            [("f", {"a": [1, "]"]})],
        ),
        (
            HERMES,
            '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
            None,
            [("f", {"a": 1})],
        ),
        (HERMES, '<tool_call>\n{"name": "f"}\n</tool_call>', None, [("f", {})]),
        (LLAMA3, '  {"name": "f", "parameters": {}}  ', None, [("f", {})]),
    ]:
        got_content, got_calls = extract_tool_calls(form, text)
        assert (got_content, calls_of(got_calls)) == (content, want), text
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
        s_content, s_calls, deltas = streamed(form, text, size)
        assert (s_content or None, calls_of(s_calls)) == (content, want), (size, text)
        # OpenAI's delta shape: a call's first delta names it, the rest carry argument text
        seen = set()
        for d in deltas:
            if d["index"] not in seen:
                seen.add(d["index"])
                assert set(d) == {"index", "id", "type", "function"}
                assert d["function"]["arguments"] == "" and d["function"]["name"]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}


@pytest.mark.parametrize(
    "form,text",
    [
        (HERMES, "Plain text, <b>no</b> calls < here <tool"),
        (HERMES, "<tool_call>\nnot json\n</tool_call> after"),
        (HERMES, '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),
        (HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
        (LLAMA3, 'The answer is {"name": "f", "parameters": {}}'),
        (LLAMA3, '{"answer": 42}'),
        (LLAMA3, '{"name": "f", "parameters": {"a": 1}'),  # cut short: not a call
        (LLAMA3, "   \n"),
    ],
)
def test_parser_leaves_other_text_alone(form, text):
    assert extract_tool_calls(form, text) == (text, [])
    for size in (1, 3):
        parser, content = ToolParser(form), ""
        for i in range(0, len(text), size):
            content += parser.feed(text[i : i + size])[0]
        content += parser.feed("", final=True)[0]
        assert content == text or parser.failed, (size, content)


def test_parser_holds_back_what_may_be_a_call():
    p = ToolParser(HERMES)
    assert p.feed("Hello <tool") == ("Hello", [])  # a tag may be forming; so may more text
    assert p.feed("s> here") == (" <tools> here", [])
    content, calls = p.feed('\n<tool_call>\n{"name": "get_w')
    assert content == "" and calls == []
    content, calls = p.feed('eather", "argu')
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert p.feed('ments": {"city"')[1][0]["function"] == {"arguments": '{"city"'}
    assert p.feed(': "Oslo"}}\n</tool_call>')[1][0]["function"] == {"arguments": ': "Oslo"}'}
    assert p.feed("", final=True) == ("", []) and p.num_calls == 1
    p = ToolParser(LLAMA3)
    assert p.feed('  {"na') == ("", [])  # JSON first: held until it is a call
    assert p.feed('me": "f", "parameters": {"x": 1}}')[1][0]["function"]["name"] == "f"


def test_tool_form_from_the_template():
    assert tool_form(HERMES_TEMPLATE) == HERMES
    assert tool_form(LLAMA3_TEMPLATE) == LLAMA3
    assert tool_form("{{ messages }}") == tool_form(None) == HERMES  # no tools rendered


# -- the live server ------------------------------------------------------------------------------


def tiny_llm(tmp_path_factory, smollm2_path, template: str) -> LLM:
    path = tmp_path_factory.mktemp("tiny-tools")
    (path / "config.json").write_text(json.dumps(TINY))
    shutil.copy(f"{smollm2_path}/tokenizer.json", path / "tokenizer.json")
    with open(f"{smollm2_path}/tokenizer_config.json") as f:
        config = json.load(f) | {"chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return LLM(
        str(path), dtype="float32", device="cpu", load_format="dummy", seed=0, num_kv_blocks=256
    )


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_path):
    return tiny_llm(tmp_path_factory, smollm2_path, HERMES_TEMPLATE).engine


def run(engine, fn):
    async def go():
        async with serving(engine, served_model_name=(MODEL,)) as client:
            c = openai.AsyncOpenAI(
                base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0
            )
            try:
                return await fn(c, client)
            finally:
                await c.close()

    return asyncio.run(go())


def check_calls(calls, names=None) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        args = json.loads(call.function.arguments)
        schema = SCHEMAS[call.function.name]
        assert list(args) == list(schema["properties"]), args  # all, in the schema's order
        for key, value in args.items():
            prop = schema["properties"][key]
            if "enum" in prop:
                assert value in prop["enum"]
            elif prop["type"] == "integer":
                assert prop["minimum"] <= value <= prop["maximum"]
            else:
                assert isinstance(value, str) and len(value) <= prop["maxLength"]


async def stream_calls(stream):
    """Per choice: (content, calls as OpenAI's accumulation rule builds them, finish_reason)."""
    out: dict[int, list] = {}
    async for chunk in stream:
        for ch in chunk.choices:
            content, calls, _ = out.setdefault(ch.index, ["", {}, None])
            out[ch.index][0] = content + (ch.delta.content or "")
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: index, id, type, name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = openai.types.chat.ChatCompletionMessageToolCall(
                        id=d.id,
                        type="function",
                        function={"name": d.function.name, "arguments": d.function.arguments},
                    )
                else:
                    assert d.function.name is None
                    calls[d.index].function.arguments += d.function.arguments
            if ch.finish_reason is not None:
                out[ch.index][2] = ch.finish_reason
    return {i: (c, [calls[k] for k in sorted(calls)], f) for i, (c, calls, f) in out.items()}


def test_required_and_named_force_valid_calls(engine):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=150)

    async def go(c, _):
        create = c.chat.completions.create
        return (
            await create(
                **kw,
                tool_choice="required",
                parallel_tool_calls=False,
                temperature=1.0,
                n=2,
                seed=1,
            ),
            await create(**kw, tool_choice=named, temperature=0),
            await stream_calls(
                await create(
                    **kw,
                    tool_choice="required",
                    parallel_tool_calls=False,
                    temperature=1.0,
                    n=2,
                    seed=2,
                    stream=True,
                )
            ),
            await stream_calls(await create(**kw, tool_choice=named, temperature=0, stream=True)),
        )

    required, forced, required_streamed, forced_streamed = run(engine, go)
    for ch in required.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        check_calls(ch.message.tool_calls)
    [ch] = forced.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    check_calls(ch.message.tool_calls, names={"get_time"})
    assert len(ch.message.tool_calls) == 1
    for content, calls, finish in required_streamed.values():
        assert finish == "tool_calls" and content == "" and len(calls) == 1
        check_calls(calls)
    assert len(required_streamed) == 2
    content, calls, finish = forced_streamed[0]
    assert (content, finish) == ("", "tool_calls")
    # greedy: the same call streamed or not (ids aside)
    assert [c.function for c in calls] == [c.function for c in ch.message.tool_calls]


def test_parallel_calls(engine):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=400)

    async def go(c, _):
        create = c.chat.completions.create
        return (
            await create(**kw, temperature=0),
            await stream_calls(await create(**kw, temperature=0, stream=True)),
        )

    whole, streamed_ = run(engine, go)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert len(ch.message.tool_calls) >= 2  # this random model's greedy choice: several calls
    check_calls(ch.message.tool_calls)
    assert len({c.id for c in ch.message.tool_calls}) == len(ch.message.tool_calls)
    content, calls, finish = streamed_[0]
    assert (content, finish) == ("", "tool_calls")
    assert [c.function for c in calls] == [c.function for c in ch.message.tool_calls]


def test_tool_history_renders_through_the_template(engine):
    tok = engine.tokenizer
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    expected = tok.apply_chat_template(
        [
            ASK[0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            history[2],
        ],
        tools=TOOLS,
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in expected
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in expected
    assert '"name": "get_time"' in expected  # the tools themselves

    async def go(c, _):
        return (
            await c.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=3
            ),
            await c.chat.completions.create(
                model=MODEL, messages=history, tools=TOOLS, max_tokens=3, temperature=0
            ),
        )

    none, auto = run(engine, go)
    assert none.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
    assert none.choices[0].message.tool_calls is None
    assert isinstance(none.choices[0].message.content, str)
    assert none.choices[0].finish_reason in ("stop", "length")
    # auto: free text, parsed; a random model's 3 tokens are no call
    assert auto.choices[0].message.content is not None
    assert auto.choices[0].finish_reason in ("stop", "length")


def test_llama3_form(tmp_path_factory, smollm2_path):
    llm = tiny_llm(tmp_path_factory, smollm2_path, LLAMA3_TEMPLATE)
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go(c, _):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0)
        return (
            await c.chat.completions.create(**kw, tool_choice=named),
            await stream_calls(
                await c.chat.completions.create(**kw, tool_choice=named, stream=True)
            ),
        )

    whole, streamed_ = run(llm.engine, go)
    ch = whole.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    check_calls(ch.message.tool_calls, names={"get_weather"})
    content, calls, finish = streamed_[0]
    assert (content, finish) == ("", "tool_calls")
    assert [c.function for c in calls] == [c.function for c in ch.message.tool_calls]


BAD = [  # (body fields, param)
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    (  # a schema xgrammar rejects: found when the forcing grammar is built
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
        "messages",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
            ]
        },
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages"),
]


def test_bad_tool_requests_are_400s(engine):
    async def go(c, client):
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )
        params = [e.value.body["param"]]
        for fields, param in BAD:
            r = await client.post("/v1/chat/completions", json={"messages": ASK} | fields)
            text = await r.text()
            assert r.status == 400, (fields, text)
            err = json.loads(text)["error"]
            assert err["param"] == param, (fields, err)
            assert "Traceback" not in text and ".py" not in text
            assert not engine.requests
        return params

    assert run(engine, go) == ["tool_choice"]
