"""Row counts and split counts of decode steps: the padded batch sizes CUDA graphs are captured
at (`graphs.py`), and the decode attention's split count and key tile, which eager and graph steps
take alike (so both sum in the same order), and the prompt lengths with a prefill graph."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch

from tinyserve.kernels import decode_attention


@functools.lru_cache(maxsize=16)
def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return tuple(sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs}))


def mixed_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode-row counts of mixed graphs (beside the chunk's sequence, so below max_num_seqs):
    powers of two (a padded decode row costs one token's matmul rows, next to nothing beside a
    prompt chunk), so there are few graphs to capture."""
    n = max_num_seqs - 1
    return sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | ({n} if n else set()))


# Key splits of a mixed graph's prompt chunk: 1, or MIXED_SPLITS once the step would take at
# least MIXED_SPLIT_FROM (kernels.prefill_attention.prefill_num_splits): a chunk at 32k keys
# beside decode rows then attends 1.2-3x faster.
MIXED_SPLITS = 8
MIXED_SPLIT_FROM = 4


def round_up(sizes: Sequence[int], n: int) -> int:
    """The smallest of the ascending `sizes` that holds n rows (n itself past the largest).
    Looked up several times a step, so a bisect rather than a scan."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else n


def padded_size(num_seqs: int, max_num_seqs: int) -> int:
    return round_up(graph_batch_sizes(max_num_seqs), num_seqs)


# Keys per decode split of a short context, and the kernel tile that holds them: 32-key splits in
# 32-key tiles beat 64 in 64 by 3-5% a batch-1 step (kernels prefetching before the PDL wait);
# but one 64-key tile (no merge pass) beats two splits up to 64 keys.
KEYS_PER_SPLIT = 32
SHORT_SPLIT_BLOCK_N = 32
# A step whose longest context would give a split more than LONG_SPLIT_KEYS keys at the GPU-
# filling count takes LONG_SPLITS splits instead, each at least LONG_MIN_SPLIT keys long, so
# short rows use their first (the rest are empty and skip their reads) and a long row all of
# them. Else one long row beside many short ones is read by one program per kv head, the step's
# tail: 4-6x slower steps (63 rows of ~300 keys and one of 32k).
LONG_SPLIT_KEYS = 4096
LONG_SPLITS = 16
LONG_MIN_SPLIT = 512
# Where one split already gives every SM a program (padded batch x kv heads >= SMs), a context of
# at most ONE_SPLIT_KEYS keys takes one split: filling the last wave with more saves less than
# their merge pass costs (steps 3-14% shorter at batch 48-144, 0.6B and 8B models).
ONE_SPLIT_KEYS = 512
# Up to LONG_ONE_SPLIT_KEYS where the last round of resident programs (RESIDENT_PROGRAMS a SM:
# the one-split kernel holds 128 registers x 128 threads, so four fit the register file) still
# gives every SM at least two: with fewer the tail round leaves bandwidth idle for the length of
# one long program (one split: steps up to 14% shorter where the rule holds, up to 10% longer
# where it does not). At head dim 64 the kernel holds 72 registers (seven resident); four keeps
# the rule on the safe side there.
LONG_ONE_SPLIT_KEYS = 4096
RESIDENT_PROGRAMS = 4


def decode_num_splits(
    num_seqs: int,
    max_num_seqs: int,
    num_kv_heads: int,
    max_len: int,
    device: torch.device,
    max_context_len: int | None = None,
) -> int:
    """Split count of a decode step: the count that fills the GPU at the padded batch size,
    cut to the power of two that gives the step's longest context at most KEYS_PER_SPLIT keys
    per split, and to one split (no merge pass) for up to 2 x KEYS_PER_SPLIT keys, or up to
    ONE_SPLIT_KEYS where one split gives every SM a program already (LONG_ONE_SPLIT_KEYS where
    its last round of resident programs gives every SM two); raised to
    LONG_SPLITS where the longest context would leave a split over LONG_SPLIT_KEYS. A function
    of the padded size and the longest context, so eager and graph steps sum in the same order.
    Verify steps take the same count (MiMo-7B batch-1 verify graph, k = 1, 32-token prompts:
    ~0.2 ms less with 1-2 splits than with 32)."""
    if device.type != "cuda":
        return 1
    full = _full_num_splits(num_seqs, max_num_seqs, num_kv_heads, max_len, device)
    if max_context_len is None:
        return full
    if max_context_len > full * LONG_SPLIT_KEYS:
        return max(full, LONG_SPLITS)
    programs = padded_size(num_seqs, max_num_seqs) * num_kv_heads
    sms = decode_attention.num_sms(device)
    if programs >= sms and max_context_len <= _one_split_keys(programs, sms):
        return 1
    tiles = -(-max_context_len // KEYS_PER_SPLIT)
    return min(full, 1 if tiles <= 2 else 1 << (tiles - 1).bit_length())


def _one_split_keys(programs: int, sms: int) -> int:
    tail = programs % (RESIDENT_PROGRAMS * sms)
    return LONG_ONE_SPLIT_KEYS if tail == 0 or tail >= 2 * sms else ONE_SPLIT_KEYS


def decode_tiling(
    num_seqs: int,
    max_num_seqs: int,
    num_kv_heads: int,
    max_len: int,
    device: torch.device,
    num_splits: int,
) -> tuple[int | None, int]:
    """(key tile, floor of a row's split length) of a decode step of num_splits splits:
    SHORT_SPLIT_BLOCK_N where the context cut the count (each split holds at most
    KEYS_PER_SPLIT keys), else the kernel's default (None: a GPU-filling count may hold long
    splits); LONG_MIN_SPLIT for a long-context count (above the GPU-filling one), else no floor
    (0). A function of the padded size and the count, so a graph and the eager steps of its key
    sum alike."""
    if device.type != "cuda":
        return None, 0
    full = _full_num_splits(num_seqs, max_num_seqs, num_kv_heads, max_len, device)
    return (
        SHORT_SPLIT_BLOCK_N if 1 < num_splits < full else None,
        LONG_MIN_SPLIT if num_splits > full else 0,
    )


@functools.lru_cache(maxsize=4096)
def _full_num_splits(
    num_seqs: int, max_num_seqs: int, num_kv_heads: int, max_len: int, device: torch.device
) -> int:
    """Cached: every decode step asks (~12 us of host time a call uncached)."""
    return decode_attention.default_num_splits(
        padded_size(num_seqs, max_num_seqs), num_kv_heads, max_len, device
    )


def prefill_graph_lengths(max_num_batched_tokens: int) -> list[int]:
    """Padded prompt lengths with a one-sequence prefill graph: where launching a forward's few
    hundred kernels one by one costs the host more than the GPU needs to run them."""
    return [t for t in (16, 32, 64, 128, 256, 512) if t <= max_num_batched_tokens]
