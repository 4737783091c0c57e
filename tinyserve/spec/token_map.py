"""The MTP draft vocabulary (`speculative_token_map`): reading a JSON map, and building one from
text (`tinyserve token-map`)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from tinyserve.config import InvalidConfig


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids an MTP head drafts from (`speculative_token_map`), as an int64 tensor.

    FR-Spec (Zhao et al., 2025) and SGLang's `--speculative-token-map`: the draft's LM head is
    restricted to the most frequent tokens, a fraction of the vocabulary, since that head is
    most of a draft's weight bytes (MiMo-7B: 1.24 of 1.66 GB per draft). Verification is
    unchanged, so outputs stay lossless; only drafts of tokens outside the map are lost. The
    file is a JSON list of ids. SGLang's maps are pickled torch `.pt` files, which this package
    never unpickles (a pickle runs code); the error says how to convert one.
    """
    name = "speculative_token_map"
    if path.endswith((".pt", ".pth")):
        raise InvalidConfig(
            name,
            f"{path}: a pickled tensor is not loaded (unpickling can run "
            "code); where you trust it, save it once as a JSON list (torch's "
            "load, .tolist(), json.dump)",
        )
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidConfig(name, f"cannot read {path}: {e}") from e
    if not isinstance(ids, list) or not ids:
        raise InvalidConfig(name, f"{path} must hold a non-empty JSON list of token ids")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise InvalidConfig(name, f"{path}: {i!r} is not a token id in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise InvalidConfig(name, f"{path} lists a token id twice")
    return torch.tensor(ids, dtype=torch.long)


def build_token_map(tokenizer, lines: Iterable[str], size: int, batch: int = 4096) -> list[int]:
    """A token map of `size` ids (at most the vocabulary): the tokenizer's special ids (an
    end-of-text draft must stay possible), then the most frequent ids of `lines` (FR-Spec's
    recipe; ties: the lower id), then the lowest ids not yet taken. A BPE vocabulary numbers
    its merges in the order training found them, most frequent first, so low ids are the prior
    where the text is too small to count: on SmolLM2's answers to 16 held-out prompts, the
    lowest 8,192 / 32,768 ids covered 88% / 98% of the tokens, where the 8,192 most frequent
    of 1 MB of package descriptions covered 79% (docs/benchmark-log.md, MTP)."""
    counts: Counter[int] = Counter()
    chunk: list[str] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == batch:
            counts.update(i for ids in tokenizer.encode_batch(chunk) for i in ids)
            chunk = []
    counts.update(i for ids in tokenizer.encode_batch(chunk) for i in ids)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    ids = dict.fromkeys(tokenizer.all_special_ids)
    ids.update(dict.fromkeys(i for i, _ in ranked))
    ids.update(dict.fromkeys(range(min(size, tokenizer.vocab_size))))  # enough to fill up
    return list(ids)[: min(size, tokenizer.vocab_size)]
