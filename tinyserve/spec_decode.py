"""Speculative decoding: draft proposers and the verification rule (counted on the device by
kernels/spec_accept.py).

A decoding row carries k drafts d_1..d_k (from the MTP head or prompt lookup) and the target runs
its last token plus the drafts in one forward: k + 1 positions, each sampled like an ordinary
decode position (same per-position RNG counter, penalties seeing the drafts before it). Row j's
sample s_j is the target's token for the position after d_j. The row keeps d_1..d_a, where a is
the longest prefix with s_j == d_{j+1}, plus s_a (the bonus token when a == k).

That is rejection sampling with a point-mass draft q = delta(d): the draft is accepted with
probability p(d) (s == d), and on rejection the emitted s is distributed as p restricted to the
other tokens, i.e. normalize(max(p - q, 0)). Every emitted token is therefore distributed exactly
as without speculation, and since s_j uses the same RNG counter as the non-speculative step at
that position, seeded and greedy outputs are token-identical with speculation on or off.
Both proposers here draft deterministically (argmax / lookup), which is what this rule needs.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tinyserve.config import InvalidConfig


@dataclass(slots=True)
class SpecStats:
    """Global acceptance counters (server metrics read them)."""

    num_drafts: int = 0  # verify rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify row: accepted drafts + the target's own (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from max_n down to min_n) and propose the k tokens that followed it."""

    def __init__(self, k: int, max_n: int = 4, min_n: int = 2) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, token_ids: list[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows starting at 0..size-n-1 (the suffix itself excluded) that equal the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if len(hits):
                start = hits[-1] + n  # the most recent match: edits repeat the nearest text
                return tokens[start : start + self.k].tolist()
        return []


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
        raise InvalidConfig(name, f"{path}: a pickled tensor is not loaded (unpickling can run "
                            "code); where you trust it, save it once as a JSON list (torch's "
                            "load, .tolist(), json.dump)")  # fmt: skip
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
    of 1 MB of package descriptions covered 79% (BENCHMARKS.md, eleventh session)."""
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
