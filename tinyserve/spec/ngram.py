"""Prompt lookup (n-gram) drafting: the tokens that followed the most recent earlier occurrence of
the context's last n tokens. No weights; pays off where answers repeat the prompt."""

from __future__ import annotations

import numpy as np


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
