"""What both server fuzz tests share: a valid body per POST route, edge-case values, the tiny
model they serve, and `check`, the one verdict on an answer (never a 5xx, the route's error shape on
a 4xx, a complete SSE stream or JSON on a 200)."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

from tinyserve import LLM

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


ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning", "web_search_call"]
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "image", "document"]


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


def make_tiny_llm(smollm2_path, tmp_path_factory):
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
