"""Tokenizer (tokenizer.json + tokenizer_config.json, no `transformers`) and streaming detokenizer.

`Tokenizer` encodes/decodes like the HF fast tokenizer and renders chat templates exactly as
`transformers.apply_chat_template` does. `IncrementalDetokenizer` turns a growing list of token ids
into text chunks that never split a UTF-8 character nor reveal any part of a stop string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

# How many prompt tokens the detokenizer decodes as left context (vLLM's value): decoders such as
# sentencepiece's drop a word's leading space at the start of a string, so context matters there.
NUM_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


class ChatTemplateError(ValueError):
    """No chat template, or the template rejected the messages (its `raise_exception`)."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template settings HF keeps in
    tokenizer_config.json."""

    def __init__(self, backend: _BackendTokenizer, config: dict[str, Any]):
        self.backend = backend
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.bos_token_id = self._id(self.bos_token)
        self.eos_token_id = self._id(self.eos_token)
        # With add_bos_token / add_eos_token present we add those tokens ourselves (as HF's
        # Llama/GPT-2 classes do); without them tokenizer.json's post-processor decides (Llama 3).
        self.has_special_flags = "add_bos_token" in config or "add_eos_token" in config
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        backend = _BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        # transformers >= 4.43 may save the template next to the config instead of inside it.
        template_path = path / "chat_template.jinja"
        if "chat_template" not in config and template_path.exists():
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls(backend, config)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of every special added token: exactly those `skip_special_tokens` drops."""
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        named = (self.bos_token, self.eos_token, self.unk_token, self.pad_token)
        ids.update(i for i in map(self._id, named) if i is not None)
        return sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a long prompt tokenized in an
        # executor thread does not stall the event loop.
        if not self.has_special_flags:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        ids = self.encode_batch([text])[0]
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (tokenized in parallel threads)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError(
                "This model's tokenizer has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja); use plain completions instead."
            )
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` as transformers does (tokenize=False); kwargs reach the template.
        `continue_final_message`: the text ends inside the last message (no end-of-turn after
        it), so the model continues it: a prefilled answer."""
        # transformers drops None-valued keys (OpenAI's content=None) so templates see them unset.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError(
                    "continue_final_message and add_generation_prompt are not compatible"
                )
            return self._render_open_ended(messages, tools, kwargs)
        special = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        variables = {k: v for k, v in special.items() if v is not None} | kwargs
        try:
            return self._compiled_template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as e:
            # TypeError: messages the template cannot handle, e.g. a list `content` where it
            # concatenates strings; like raise_exception, that is the client's error.
            raise ChatTemplateError(f"chat template error: {e}") from e

    def _render_open_ended(self, messages: list[dict], tools, kwargs: dict) -> str:
        """transformers' continue_final_message: render with a tag after the last message's
        content and cut the text at the tag (and the whitespace before it, where the template
        trims the content)."""
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str) or not final.strip():
            raise ChatTemplateError(
                "continue_final_message needs a final message with text content to continue"
            )
        messages = messages[:-1] + [{**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self.apply_chat_template(messages, False, tools, **kwargs)
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final.strip() not in text:
            raise ChatTemplateError(
                "continue_final_message: the chat template does not render the final message's "
                "content as given"
            )
        at = text.rindex(tag)
        return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()


def _token_content(token: str | dict | None) -> str | None:
    """tokenizer_config.json spells a special token as a string or as a serialized AddedToken."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' override: jinja's built-in tojson HTML-escapes and sorts keys.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_template(template: str) -> jinja2.Template:
    """Same environment as transformers' `_compile_jinja_template` (chat templates are untrusted
    code from the Hub, hence the immutable sandbox)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one `add` per step, then one `flush` at the end.

    UTF-8 safety (vLLM / TGI): decode the window ids[prefix_offset:] and subtract the text of
    ids[prefix_offset:read_offset] that was already emitted; accept only if the window's text grew
    and does not end in U+FFFD (a character whose remaining bytes are still to come).

    Stop strings: a stop may span tokens. Text is released only up to the point where no stop can
    begin: the longest tail that is a proper prefix of some stop string is held back until later
    text resolves it. Invariant: no stop can start inside the released text (every released
    position was ruled out), so matches are searched for only in the unreleased part.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.max_hold_len = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids = list(prompt_ids[-NUM_CONTEXT_TOKENS:])  # context tail + output ids
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output = ""  # decoded output text, including the held-back tail
        self.num_released = 0  # chars of `output` returned so far
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """All text returned so far (never a stop string or anything after it)."""
        return self.output[: self.num_released]

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly releasable text ("" once stopped)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        self._decode(is_final=False)
        return self._release(is_final=False)

    def flush(self) -> str:
        """At the end of generation: decode any incomplete character as U+FFFD, as a full
        decode would, and release the held-back text unless it completes a stop."""
        if self.stopped:
            return ""
        self._decode(is_final=True)
        return self._release(is_final=True)

    def _decode(self, is_final: bool) -> None:
        decode = self.tokenizer.decode
        ids, skip = self.token_ids, self.skip_special_tokens
        prefix_text = decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        new_text = decode(ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(new_text) > len(prefix_text) and (
            is_final or not new_text.endswith(REPLACEMENT_CHAR)
        ):
            self.output += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def _release(self, is_final: bool) -> str:
        start, end = self.num_released, len(self.output)
        if self.stop:
            # Stop at the match that completes first (ties: the one starting first), as a
            # character-by-character stream would, so chunking cannot change the result.
            matches = [
                (i + len(s), i, s) for s in self.stop if (i := self.output.find(s, start)) >= 0
            ]
            if matches:
                _, end, self.stop_reason = min(matches)
                self.stopped = True
            elif not is_final:
                end -= self._num_held_back(start)
        self.num_released = end
        return self.output[start:end]

    def _num_held_back(self, start: int) -> int:
        """Length of the longest unreleased tail of `output` that some stop string starts with."""
        for n in range(min(self.max_hold_len, len(self.output) - start), 0, -1):
            tail = self.output[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
