"""A small checkpoint whose chat template thinks, for the reasoning, /v1/responses and /v1/messages
tests: the tiny random Llama of test_api_tools (SmolLM2's tokenizer, which splits `<think>` and
`</think>` into several tokens) with its Hermes tool template, ending the prompt as Qwen3's does:
`<think>\\n\\n</think>\\n\\n` when `enable_thinking` is false, `<think>\\n` (Qwen3.5's way) when the
`think_in_prompt` kwarg is true, else nothing (the model opens the block itself).

The random model's text is noise, so tests force what it writes with vLLM's `structured_outputs`
regex, sent through each client's `extra_body` (`forced`), greedy.
"""

from __future__ import annotations

import asyncio
import re

from test_api_tools import HERMES_TEMPLATE, MODEL, TIME, tiny_llm
from test_server import serving

GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_PROMPT = """{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- elif think_in_prompt is defined and think_in_prompt %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""
assert GENERATION_PROMPT in HERMES_TEMPLATE
THINK_TEMPLATE = HERMES_TEMPLATE.replace(GENERATION_PROMPT, THINKING_PROMPT)
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": TIME}}
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def thinking_llm(tmp_path_factory, smollm2_path):
    return tiny_llm(tmp_path_factory, smollm2_path, THINK_TEMPLATE)


def forced(text: str) -> dict:
    """extra_body fields that make the model write exactly `text` (then end), greedy."""
    regex = re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text).replace("\n", "\\n")
    return {"structured_outputs": {"regex": regex}, "temperature": 0}


def run_server(engine, fn, reasoning_parser: str | None = "qwen3", **config):
    """fn(client: aiohttp TestClient) on a live server (served as MODEL) around `engine`."""

    async def go():
        async with serving(
            engine, served_model_name=(MODEL,), reasoning_parser=reasoning_parser, **config
        ) as client:
            return await fn(client)

    return asyncio.run(go())


__all__ = ["CALL", "MODEL", "THINK_TEMPLATE", "TIME", "TIME_TOOL", "forced", "run_server"]
