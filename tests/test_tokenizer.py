"""Tokenizer and IncrementalDetokenizer tests.

Fast tests use a tiny byte-level BPE built here (every multi-byte character spans several tokens).
Slow ones check the converted SmolLM2 tokenizer against transformers loading the GGUF directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tinyserve.model.gguf import default_gguf_path
from tinyserve.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TINY_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "Emoji: 🌍🚀👩‍👩‍👧‍👦 👍🏽 ❤️",
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "whitespace   runs\n\n\n  and   tabs\t\t\t end   ",
    "digits 0 12 345 6789 3.14159 1e-5 2024-11-26   1    22",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tinyserve<file_sep>x<|im_end|> trailing",
    "Ünïcödé: naïve café résumé — “quotes” ‘single’ … 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u00a0nbsp \u200bzw",
    "mixed123abc   456\r\n\r\nCRLF lines\rCR",
    "",
    " leading space and trailing ",
]
STREAM_TEXTS = ["Hi 🌍 and 👩‍👩‍👧 ok", "中文，日本語、한국어", "𝔘𝔫𝔦 ȸ 𓀀 \U0010fffd end"]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3 🌍"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]
MIXED = st.one_of(
    st.characters(min_codepoint=32, max_codepoint=126),
    st.sampled_from(" \n\t"),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1F64F),
)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Byte-level BPE over the 256 byte symbols, a few merges that cut through characters
    ("aÃ" is "a" plus the first byte of "é"), two special tokens and a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|im_start|>", "<|im_end|>"]
    merges = [("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("a", "Ã"), ("ð", "Ł")]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet + [a + b for a, b in merges])}
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    path = tmp_path_factory.mktemp("tiny")
    backend.save(str(path / "tokenizer.json"))
    config = {
        "add_bos_token": False,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": TINY_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def smol(smollm2_path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_path)  # smollm2_path: conftest.py, converted once


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    gguf = Path(default_gguf_path())
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def stream(tok: Tokenizer, ids: list[int], stop=(), skip=True, chunk=1) -> tuple[list[str], str]:
    """Feed `ids` `chunk` at a time; returns the chunks (flush last) and det.text."""
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, stop=stop)
    chunks = [det.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    chunks.append(det.flush())
    return chunks, det.text


def expected_output(full: str, stop) -> str:
    """The text a char-by-char stream would keep: cut at the stop that completes first."""
    hits = [(i + len(s), i) for s in stop if s and (i := full.find(s)) >= 0]
    return full[: min(hits)[1]] if hits else full


# --- Tokenizer basics (tiny) ---


def test_tiny_encode_decode(tiny):
    ids = tiny.encode("a world<|im_end|>")
    assert ids[-1] == tiny.eos_token_id == 1 and tiny.bos_token_id == 0
    assert tiny.decode(ids) == "a world"
    assert tiny.decode(ids, skip_special_tokens=False) == "a world<|im_end|>"
    assert tiny.all_special_ids == [0, 1]
    assert tiny.vocab_size == 2 + 256 + 5


def test_add_bos_token_from_config(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.encode("hi") == [tok.bos_token_id, *tok.encode("hi", add_special_tokens=False)]


def test_chat_template_tiny(tiny):
    msgs = [{"role": "user", "content": "hi", "name": None}]
    assert (
        tiny.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"name": "f", "description": "é <b>"}]
    out = tiny.apply_chat_template(msgs, add_generation_prompt=False, tools=tools)
    assert out.endswith('[{"name": "f", "description": "é <b>"}]')  # no HTML escaping, UTF-8
    with pytest.raises(ChatTemplateError, match="bad role"):
        tiny.apply_chat_template([{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # content is concatenated as a string
        tiny.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])


def test_missing_chat_template(tiny_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


# --- IncrementalDetokenizer (tiny) ---


def test_stream_never_splits_characters(tiny):
    ids = tiny.encode("aé 🌍 中")
    chunks, text = stream(tiny, ids)
    assert "".join(chunks) == text == "aé 🌍 中"
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[:3] == ["", "aé", " "]  # "aÃ" is held until "©" completes the "é"


def test_invalid_utf8_flushed_like_full_decode(tiny):
    ids = tiny.encode("x🌍")[:-2]  # drop the last two bytes of the emoji
    chunks, text = stream(tiny, ids)
    assert chunks[-1] == "\ufffd" and text == tiny.decode(ids) == "x\ufffd"


def test_stop_spanning_tokens_is_excluded(tiny):
    ids = tiny.encode("say STOP now")  # one token per byte: the stop spans four tokens
    chunks, text = stream(tiny, ids, stop=["STOP"])
    assert text == "".join(chunks) == "say "
    det = IncrementalDetokenizer(tiny, [], stop=["STOP"])
    released = "".join(det.add([i]) for i in ids)
    assert released == "say " and det.stopped and det.add(tiny.encode("more")) == ""


def test_partial_stop_is_held_then_released(tiny):
    det = IncrementalDetokenizer(tiny, [], stop=["<END>", "xyz"])
    assert "".join(det.add([i]) for i in tiny.encode("ab<EN")) == "ab"  # "<EN" could be "<END>"
    assert det.add(tiny.encode("x")) == "<EN"  # resolved: not a stop; "x" may begin "xyz"
    assert det.text == "ab<EN" and not det.stopped
    assert det.flush() == "x" and det.text == "ab<ENx"


def test_stop_completing_first_wins(tiny):
    assert stream(tiny, tiny.encode("abcd"), stop=["abcd", "bc"], chunk=4)[1] == "a"
    assert stream(tiny, tiny.encode("abcd"), stop=["bcd", "abc"], chunk=4)[1] == ""


def test_stop_on_special_token_text(tiny):
    ids = tiny.encode("ok<|im_end|>more")
    assert stream(tiny, ids, stop=["<|im_end|>"], skip=False)[1] == "ok"
    assert stream(tiny, ids, stop=["<|im_end|>"], skip=True)[1] == "okmore"


def test_prompt_context_not_in_output(tiny):
    det = IncrementalDetokenizer(tiny, tiny.encode("<|im_start|>ab 🌍"))
    assert det.add(tiny.encode(" 中")) + det.flush() == " 中"


@pytest.mark.parametrize("tok_name", ["tiny", pytest.param("smol", marks=pytest.mark.slow)])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_property(request, tok_name, data):
    tok = request.getfixturevalue(tok_name)
    text = data.draw(st.text(MIXED, max_size=30))
    if text and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(text) - 1))
        stop = [text[i : i + data.draw(st.integers(1, 4))]]
    else:
        stop = data.draw(st.lists(st.text(MIXED, min_size=1, max_size=3), max_size=2))
    ids = tok.encode(text)
    chunk = data.draw(st.integers(1, 3))
    det = IncrementalDetokenizer(tok, [], stop=stop)
    expected = expected_output(tok.decode(ids), stop)
    released = ""
    for i in range(0, len(ids), chunk):
        released += det.add(ids[i : i + chunk])
        # A client never sees a partial character nor any part of a stop string that matches.
        assert "\ufffd" not in released and expected.startswith(released)
        # ... and holds back only text from the first position where a stop could still start.
        so_far = tok.decode(ids[: i + chunk])
        if not det.stopped and not so_far.endswith("\ufffd"):
            n = len(so_far)
            q = next((p for p in range(n) if any(s.startswith(so_far[p:]) for s in stop)), n)
            assert released == so_far[:q]
    released += det.flush()
    assert released == det.text == expected


# --- SmolLM2 tokenizer vs transformers (slow) ---


@pytest.mark.slow
def test_corpus_ids_match_transformers(smol, hf_tokenizer):
    for text in CORPUS:
        want = hf_tokenizer(text)["input_ids"]
        assert smol.encode(text) == want, text
        assert smol.decode(want) == hf_tokenizer.decode(want, skip_special_tokens=True)
        assert smol.decode(want, skip_special_tokens=False) == hf_tokenizer.decode(want)
    assert smol.encode("   1") == hf_tokenizer("   1")["input_ids"]  # no digit pre-split
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert set(hf_tokenizer.all_special_ids) <= set(smol.all_special_ids)
    assert smol.vocab_size == len(hf_tokenizer) == 49152


@pytest.mark.slow
def test_chat_template_matches_transformers(smol, hf_tokenizer):
    for msgs in MESSAGES:
        for gen in (True, False):
            want = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert smol.apply_chat_template(msgs, add_generation_prompt=gen) == want
    # HF-specific environment features: tojson without HTML escaping, raise_exception, bos_token.
    template = TINY_TEMPLATE + "{{ bos_token }}{{ tools | tojson(indent=2) }}"
    tools = [{"type": "function", "function": {"name": "f", "description": "<é>"}}]
    want = hf_tokenizer.apply_chat_template(
        MESSAGES[1], tools=tools, chat_template=template, tokenize=False
    )
    smol_custom = Tokenizer(smol.backend, smol.config | {"chat_template": template})
    assert (
        smol_custom.apply_chat_template(MESSAGES[1], add_generation_prompt=False, tools=tools)
        == want
    )


@pytest.mark.slow
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_smol_stream_equals_full_decode(smol, text):
    ids = smol.encode(text + "<|im_end|>")
    for skip in (True, False):
        chunks, streamed = stream(smol, ids, skip=skip)
        assert "".join(chunks) == streamed == smol.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in c for c in chunks)
    assert "".join(stream(smol, ids, stop=[text[3:6]])[0]) == text[:3]
