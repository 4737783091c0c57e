"""Shared by test_sampler.py and test_sampler_rng.py: sampling rows from parameters, and the
per-row references of the kept set (top-k -> top-p -> min-p) and of the penalties."""

from __future__ import annotations

import math
from collections import Counter

import torch

from tinyserve.sample.sampler import SamplingRow
from tinyserve.sampling_params import SamplingParams


def rows_for(params, seeds=None, prompts=None, outputs=None):
    n = len(params)
    seeds = seeds if seeds is not None else list(range(n))
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    return [
        SamplingRow(p, s, pr, o)
        for p, s, pr, o in zip(params, seeds, prompts, outputs, strict=True)
    ]


def ref_keep(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Straightforward per-row reference of the top-k -> top-p -> min-p kept set (float64)."""
    x = x.double().tolist()
    order = sorted(range(len(x)), key=lambda v: (-x[v], v))
    if top_k > 0:
        order = order[:top_k]

    def probs(ids):
        m = max(x[v] for v in ids)
        w = {v: math.exp(x[v] - m) for v in ids}
        s = sum(w.values())
        return {v: w[v] / s for v in ids}

    if top_p < 1:
        p, mass, kept = probs(order), 0.0, []
        for v in order:
            if mass >= top_p:
                break
            kept.append(v)
            mass += p[v]
        order = kept
    if min_p > 0:
        p = probs(order)
        p_max = max(p.values())
        order = [v for v in order if p[v] >= min_p * p_max]
    return set(order)


def ref_penalties(x: torch.Tensor, p: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    x = x.double().clone()
    for v in set(prompt_ids) | set(output_ids):
        x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
    for v, c in Counter(output_ids).items():
        x[v] -= p.frequency_penalty * c + p.presence_penalty
    return x
