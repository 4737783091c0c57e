"""The chat template's inputs from a request: its switches (`add_generation_prompt`,
`continue_final_message`), vLLM's `chat_template_kwargs` (e.g. `{"enable_thinking": false}`, read
by Qwen3's template), and the render itself: messages (+ tools) -> prompt text and ids. A template
that raises or cannot handle the messages is the client's error (a 400 naming `messages`).
"""

from __future__ import annotations

from typing import Any

from tinyserve.model.tokenizer import ChatTemplateError, Tokenizer
from tinyserve.sampling_params import InvalidParameter

MAX_TEMPLATE_KWARGS = 32
# Variables the server sets itself; a client's chat_template_kwargs may not replace them.
RESERVED = ("messages", "tools", "add_generation_prompt", "continue_final_message")


def render_options(body: dict) -> dict[str, Any]:
    """The template's switches (vLLM's names and defaults): add_generation_prompt (true) ends the
    text with the assistant's header; continue_final_message (false) ends it inside the last
    message, which the model then continues. Then chat_template_kwargs. Raises
    InvalidParameter."""
    add = _flag(body, "add_generation_prompt")
    cont = bool(_flag(body, "continue_final_message"))
    add = not cont if add is None else add
    if add and cont:
        raise InvalidParameter(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        )
    options = {"add_generation_prompt": add, "continue_final_message": cont}
    return template_kwargs(body.get("chat_template_kwargs")) | options


def _flag(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidParameter(key, f"{key} must be a boolean")
    return value


def template_kwargs(value: Any) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: extra variables for the template (any JSON values)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidParameter(
            "chat_template_kwargs",
            f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS} variables",
        )
    taken = [k for k in value if k in RESERVED or not k.isidentifier()]
    if taken:
        raise InvalidParameter(
            "chat_template_kwargs",
            f"chat_template_kwargs: {taken[0][:64]!r} is not a variable a request may set",
        )
    return dict(value)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    options: dict | None = None,
) -> tuple[list[int], str]:
    """The prompt's (ids, text); `tools` reach the template's own `tools` variable (as vLLM: a
    template that ignores them renders none); `options`: render_options. Raises
    InvalidParameter("messages")."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, **(options or {}))
    except ChatTemplateError as e:
        raise InvalidParameter("messages", str(e)) from None
    return tokenizer.encode(text, add_special_tokens=False), text
