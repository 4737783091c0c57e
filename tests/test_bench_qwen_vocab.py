"""tinyserve.bench.qwen_vocab on a tiny synthetic .tiktoken: 256 byte tokens plus merges whose
rank order is not the order a left-to-right reading would guess (the real file is not needed)."""

from __future__ import annotations

import base64
import json

import pytest

from tinyserve.bench.qwen_vocab import (
    ADDED_TOKENS,
    NUM_SPECIAL,
    byte_to_unicode,
    convert,
    last_merge,
    read_tiktoken,
)
from tinyserve.model.tokenizer import Tokenizer
from tinyserve.sample.grammar import vocab_type

# Ranks 256 on. "lo" outranks "ll", so "hello" is made of hel + lo, while "hell" is he + ll.
MERGED = [b"lo", b"ll", b"he", b"hel", b"hello", b"hell", b" w", b"or", b" wor", b"ld", b" world"]
MERGED += ["é".encode(), "日".encode()[:2], "日".encode()]  # multi-byte UTF-8
IDS = {tok: 256 + i for i, tok in enumerate(MERGED)}


def _write(path, tokens: list[bytes]) -> None:
    lines = (f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens))
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_vocab")
    _write(root / "tiny.tiktoken", [bytes([b]) for b in range(256)] + MERGED)
    return convert(root / "tiny.tiktoken", root / "tok")


def test_byte_to_unicode_is_gpt2s():
    b2u = byte_to_unicode()
    assert len(set(b2u.values())) == 256
    assert (b2u[ord(" ")], b2u[ord("\n")], b2u[ord("a")], b2u[0xC3]) == ("Ġ", "Ċ", "a", "Ã")


def test_merges_follow_rank_order(tok_dir):
    ranks = read_tiktoken(tok_dir.parent / "tiny.tiktoken")
    assert last_merge(ranks, b"hello") == (b"hel", b"lo")
    assert last_merge(ranks, b"hell") == (b"he", b"ll")
    merges = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) == len(MERGED)  # one per multi-byte token, in rank order
    assert merges[:6] == [
        ["l", "o"],
        ["l", "l"],
        ["h", "e"],
        ["he", "l"],
        ["hel", "lo"],
        ["he", "ll"],
    ]
    assert merges[6] == ["Ġ", "w"]
    ranks[b"xyz"] = len(ranks)  # no lower-ranked path leads to it
    with pytest.raises(ValueError, match="no merge"):
        last_merge(ranks, b"xyz")


def test_tokenizer_encodes_like_bpe_by_rank(tok_dir):
    tok = Tokenizer.from_pretrained(tok_dir)
    assert tok.encode("hello world") == [IDS[b"hello"], IDS[b" world"]]
    assert tok.encode("hells") == [IDS[b"hell"], ord("s")]
    # " héllo": "lo" merges before "é", so "ll" can no longer form
    assert tok.encode(" héllo") == [ord(" "), ord("h"), IDS["é".encode()], ord("l"), IDS[b"lo"]]
    assert tok.encode("日本") == [IDS["日".encode()], *"本".encode()]
    for text in ["hello world", "  x\n\n\ty = 'a'  ", "héllo 日本 😀", "It's ok, THEY'LL see"]:
        assert tok.decode(tok.encode(text)) == text


def test_added_tokens_and_config(tok_dir):
    tok = Tokenizer.from_pretrained(tok_dir)
    base = 256 + len(MERGED)
    assert tok.vocab_size == base + len(ADDED_TOKENS)
    assert (tok.eos_token_id, tok.pad_token, tok.bos_token_id) == (base + 2, "<|endoftext|>", None)
    assert tok.all_special_ids == list(range(base, base + NUM_SPECIAL))
    think = base + ADDED_TOKENS.index("<think>")
    ids = tok.encode("<|im_start|>hello<think>world<|im_end|>")
    assert ids == [base + 1, IDS[b"hello"], think, ord("w"), IDS[b"or"], IDS[b"ld"], base + 2]
    assert tok.decode(ids) == "hello<think>world"  # special tokens skipped, <think> is text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert vocab_type(json.loads(tok.backend.to_str())) == (2, False)  # xgrammar's BYTE_LEVEL
