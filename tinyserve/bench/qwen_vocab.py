"""Qwen's byte-level BPE vocabulary as an HF tokenizer directory, for `bench.py structured` on
Qwen shapes with dummy weights (a grammar's mask fill depends on the real 151,643-token vocabulary).

Source: `pip download --no-deps dashscope`, unzip the wheel, `dashscope/resources/qwen.tiktoken`
(lines of `base64(token bytes) rank`; the regular vocabulary of Qwen2, Qwen2.5 and Qwen3).
`python -m tinyserve.bench.qwen_vocab PATH/TO/qwen.tiktoken OUT_DIR` writes tokenizer.json and
tokenizer_config.json there, with Qwen3's added tokens from id 151,643 on."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

# Qwen2's pre-tokenizer split (tiktoken's pattern for the same vocabulary).
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3's added tokens, ids from 151,643 on; the first NUM_SPECIAL are special (decode skips them),
# the tool-call, fill-in-the-middle and think tags are plain text to decode.
ADDED_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> "
    "<|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> "
    "<|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> "
    "<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response> </tool_response> "
    "<think> </think>"
).split()
NUM_SPECIAL = 14
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the rest take the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    extra = (b for b in range(256) if b not in keep)
    return {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(extra)}


def read_tiktoken(path: str | Path) -> dict[bytes, int]:
    lines = Path(path).read_text(encoding="ascii").splitlines()
    return {base64.b64decode(tok): int(rank) for tok, rank in (ln.split() for ln in lines if ln)}


def last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The pair whose merge makes `token`: BPE on its bytes with only lower-ranked tokens
    allowed (the lowest-ranked adjacent pair merges first) must stop at two parts."""
    parts, max_rank = [token[i : i + 1] for i in range(len(token))], ranks[token]
    while len(parts) > 2:
        rank, i = min(
            (ranks.get(a + b, max_rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))
        )
        if rank >= max_rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {ranks[token]}) is no merge of lower ranks")
    return parts[0], parts[1]


def tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """tokenizer.json of Qwen2's byte-level BPE: merges ordered by the rank of what they make,
    so HF's lowest-merge-first BPE takes tiktoken's lowest-rank-first steps."""
    b2u = byte_to_unicode()
    text = {tok: "".join(b2u[b] for b in tok) for tok in ranks}
    merges = [
        [text[a], text[b]]
        for a, b in (last_merge(ranks, t) for t in sorted(ranks, key=ranks.get) if len(t) > 1)
    ]
    base = max(ranks.values()) + 1
    added = [
        dict(id=base + i, content=t, single_word=False, lstrip=False, rstrip=False)
        | dict(normalized=False, special=i < NUM_SPECIAL)
        for i, t in enumerate(ADDED_TOKENS)
    ]
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)
    split = dict(type="Split", pattern={"Regex": SPLIT_REGEX}, behavior="Isolated", invert=False)
    model = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix="")
    model |= dict(end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,  # as tiktoken; Qwen's own tokenizer.json NFC-normalizes the input
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": model | {"vocab": {text[t]: r for t, r in ranks.items()}, "merges": merges},
    }


def convert(tiktoken_path: str | Path, out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json for `tiktoken_path` into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = tokenizer_json(read_tiktoken(tiktoken_path))
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    config = dict(add_bos_token=False, bos_token=None, eos_token="<|im_end|>")
    config |= dict(pad_token="<|endoftext|>", unk_token=None, chat_template=CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m tinyserve.bench.qwen_vocab QWEN_TIKTOKEN OUT_DIR")
    print(convert(sys.argv[1], sys.argv[2]))
