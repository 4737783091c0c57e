"""A step's logits on the way to the sampler: the sampled rows' logits (a graph's or the LM
head's), the scored prompt tokens' logprobs, the min_tokens stop-token mask and the RNG counter
steps of rows shifted past the step in flight. All enqueued on the device: no host sync."""

from __future__ import annotations

import torch

from tinyserve.runner.pending import PendingStep, PromptScores, to_host
from tinyserve.runner.step_inputs import HostInputs, StepInputs
from tinyserve.sample.sampler import SamplingRow
from tinyserve.sample.transfer import to_device


def sampled_logits(
    model,
    h: HostInputs,
    x: StepInputs | None,
    hidden: torch.Tensor,
    all_logits: torch.Tensor | None,
    graph_rows: bool,
    device: torch.device,
) -> torch.Tensor:
    """(R, V) float32 logits of the sampled rows: the graph's, or the LM head's (eager)."""
    if graph_rows:
        return all_logits[: len(h.logits_idx)]  # a mixed graph's chunk may not sample
    idx = x.idx if x is not None else to_device(h.logits_idx, device)
    if all_logits is not None:
        return all_logits[idx]
    return model.compute_logits(hidden[idx])


def prompt_scores(
    model,
    h: HostInputs,
    x: StepInputs,
    hidden: torch.Tensor,
    max_num_seqs: int,
    device: torch.device,
) -> PromptScores:
    """Logprobs of the prompt tokens this step scores: float32 log_softmax of the logits of the
    positions before them, the scored token's gathered and the top-k, copied to pinned host
    memory with the step's results. The logits go through in slices of max_num_seqs rows (what
    num_kv_blocks' profile left room for): never (P, V) floats at once."""
    idx, next_ids = x.prompt  # (P,) token index in this step, (P,) the token it scores
    num, k, dev = len(h.prompt_idx), h.prompt_top_k, device
    logprobs = torch.empty(num, dtype=torch.float32, device=dev)
    top_ids = torch.empty(num, k, dtype=torch.long, device=dev) if k else None
    top_lps = torch.empty(num, k, dtype=torch.float32, device=dev) if k else None
    for a in range(0, num, max_num_seqs):
        b = min(num, a + max_num_seqs)
        lp = torch.log_softmax(model.compute_logits(hidden[idx[a:b]]), dim=-1)  # (b-a, V)
        logprobs[a:b] = lp.gather(1, next_ids[a:b, None]).squeeze(1)
        if k:
            top_lps[a:b], top_ids[a:b] = lp.topk(k, dim=-1)
    host = [to_host(t) for t in (logprobs, top_ids, top_lps)]
    return PromptScores(h.prompt_rows, h.prompt_next, host)


def step_shift(
    prev: PendingStep, shift: tuple[torch.Tensor, ...], num_rows: int, device: torch.device
) -> torch.Tensor:
    """(R,) RNG counter steps each logits row still lacks: a row's counter is its emitted count,
    which the step in flight raises by the drafts it accepts (so seeded sampling draws what the
    synchronous loop draws)."""
    _, seq, _, _, _, logit = shift
    steps = torch.zeros(num_rows, dtype=torch.long, device=device)
    return steps.index_add_(0, logit, prev.num_accepted()[seq])  # each shifted row, once


def mask_stop_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], eos_ids: list[int], device: torch.device
) -> None:
    """min_tokens: stop tokens cannot be sampled before a row has min_tokens outputs."""
    r, c = [], []
    for i, row in enumerate(rows):
        p = row.params
        if row.num_output_tokens < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            r += [i] * len(ids)
            c += sorted(ids)
    if r:
        idx = torch.tensor([r, c], pin_memory=device.type == "cuda")
        idx = idx.to(device, non_blocking=True)  # pageable -> device would sync
        logits[idx[0], idx[1]] = float("-inf")
