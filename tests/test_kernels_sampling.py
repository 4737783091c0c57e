"""The sampling kernels (counter RNG, the Gumbel race sampler, argmax) against the torch
sampler, and their chunking and compile rules."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import BF16, DEVICE, gpu, needs_triton, randn

from tinyserve.kernels.sampling import argmax, counter_uniform, sample_race, sample_race_ref

pytestmark = [needs_triton, pytest.mark.usefixtures("seed_torch")]


def test_counter_uniform_stream_is_the_samplers():
    from tinyserve.sample.sampler import counter_key
    from tinyserve.sample.sampler import counter_uniform as torch_uniform

    seeds = torch.tensor([0, -1, 2**62 + 12345, -(2**63), 77], device=DEVICE)
    keys = counter_key(seeds, torch.tensor([0, 1, 5, 1000, 3], device=DEVICE))
    assert torch.equal(counter_uniform(keys, 3001), torch_uniform(keys, 3001))


@pytest.mark.parametrize("num_chunks", [None, 1, 3])
def test_sample_race_matches_reference(num_chunks):
    from tinyserve.sample.sampler import counter_key

    keys = counter_key(
        torch.randint(-(2**62), 2**62, (6,), device=DEVICE), torch.arange(6, device=DEVICE)
    )
    x = randn(6, 3000, scale=4.0)
    x[1, 100:] = float("-inf")  # top-k style mask
    x[2, :] = 0.0  # all ties: the race alone decides
    greedy = torch.tensor([False, True, False, False, True, False], device=DEVICE)
    x[4, 2000] = x[4, 17] = x[4].max() + 1  # greedy tie: the lower index wins
    ids = sample_race(x, keys, greedy, num_chunks=num_chunks)
    assert torch.equal(ids, sample_race_ref(x, keys, greedy))
    assert ids[4] == 17
    assert torch.equal(sample_race(x, keys, num_chunks=num_chunks), sample_race_ref(x, keys))


@pytest.mark.parametrize(
    ("batch", "vocab"), [(1, 5000), (5, 3001), (3, 37), (64, 2048), (40, 7001)]
)
def test_argmax(batch, vocab):
    """torch.argmax's ids, ties to the lowest index across chunk boundaries, into out."""
    x = randn(batch, vocab, scale=4.0)
    x[0, vocab // 2] = x[0, vocab - 1] = x[0, 3] = x[0].max() + 1  # ties in different chunks
    if batch > 1:
        x[1, :] = -1.0  # all equal: id 0
        x[1, 5:] = float("-inf")
    if batch > 2:
        x[2, :] = float("-inf")  # nothing allowed: id 0, as torch
    out = torch.full((batch,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax(x, out) is out
    assert torch.equal(out, x.argmax(-1))
    assert out[0] == 3
    assert torch.equal(argmax(x[:, : vocab // 2]), x[:, : vocab // 2].argmax(-1))  # strided rows


def test_argmax_through_a_token_map():
    """With `ids` (a draft head's token map) the maximum's mapped id, ties as without."""
    x = randn(5, 3000, scale=4.0)
    x[0, 2500] = x[0, 7] = x[0].max() + 1  # a tie across chunks: column 7 wins
    ids = torch.randperm(50000, device=DEVICE)[:3000]
    out = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
    assert argmax(x, out, ids) is out
    assert torch.equal(out, ids[x.argmax(-1)]) and out[0] == ids[7]
    with pytest.raises(ValueError, match="ids must be"):
        argmax(x, ids=ids[:10])


def test_race_takes_chunks_of_two_tiles_at_any_batch(monkeypatch):
    """The argmax and the sampler split each row's vocabulary into chunks of two 1,024-wide
    tiles whatever the batch, unless a chunk count is asked for (fewer, longer chunks at large
    batches were slower: BENCHMARKS.md)."""
    from tinyserve.kernels import sampling as kernel

    grids, chunk_kernel = [], kernel._race_chunk_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return chunk_kernel[grid]

    monkeypatch.setattr(kernel, "_race_chunk_kernel", Spy())
    vocab = 7001  # 7 tiles: 4 chunks, the last of one tile
    for batch in (1, 40):
        x = randn(batch, vocab, scale=4.0)
        keys = torch.arange(batch, dtype=torch.int64, device=DEVICE)
        assert torch.equal(argmax(x), x.argmax(-1))
        assert torch.equal(sample_race(x, keys), sample_race_ref(x, keys))
        assert torch.equal(sample_race(x, keys, num_chunks=2), sample_race_ref(x, keys))
        assert grids[-3:] == [(batch, 4), (batch, 4), (batch, 2)]


def test_race_compiles_once_per_vocab_whatever_the_batch(monkeypatch):
    """The race kernels' compile-time arguments do not depend on the batch: an eager step of a
    new size must not compile (a compile stalls the step loop: BENCHMARKS.md)."""
    from tinyserve.kernels import sampling as kernel

    seen = {}

    class Spy:  # records each launch's constexprs (upper-case kwargs), then launches
        def __init__(self, name):
            self.fn, self.name = getattr(kernel, name), name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constexprs = tuple(sorted((k, v) for k, v in kwargs.items() if k.isupper()))
                seen.setdefault(self.name, set()).add(constexprs)
                return self.fn[grid](*args, **kwargs)

            return launch

    for name in ("_race_chunk_kernel", "_race_pick_kernel"):
        monkeypatch.setattr(kernel, name, Spy(name))
    vocab = 5000
    for batch in (1, 2, 3, 5, 9, 17, 40, 100, 300):
        x = randn(batch, vocab, scale=4.0)
        assert torch.equal(argmax(x), x.argmax(-1))
    assert {k: len(v) for k, v in seen.items()} == {"_race_chunk_kernel": 1, "_race_pick_kernel": 1}


def test_argmax_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32"):
        argmax(randn(2, 10, dtype=BF16))
    with pytest.raises(ValueError, match="out must be"):
        argmax(randn(2, 10), torch.empty(3, dtype=torch.int64, device=DEVICE))


def test_sample_race_equals_sampler_tokens():
    """Processed logits + keys from SamplingTensors: the torch sampler's tokens exactly."""
    from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample
    from tinyserve.sampling_params import SamplingParams

    temps = [0.0, 0.7, 1.0, 1.3, 0.0, 0.9]
    rows = [
        SamplingRow(
            SamplingParams(temperature=t, seed=i), seed=i, prompt_ids=[1], output_ids=[2] * i
        )
        for i, t in enumerate(temps)
    ]
    tensors = SamplingTensors.build(rows, 2000, DEVICE)
    logits = randn(6, 2000, scale=3.0)
    processed = logits / tensors.temperature[:, None]
    ids = sample_race(processed, tensors.rng_keys, tensors.is_greedy)
    assert torch.equal(ids, sample(logits, tensors).token_ids)


@gpu
def test_sampler_on_gpu_draws_the_cpu_samplers_tokens(monkeypatch):
    """`sample` on CUDA takes the fused race; the CPU takes the torch ops. Same processed
    logits and keys (filters, greedy rows, seeds): the same tokens."""
    from tinyserve.kernels import sampling as kernel
    from tinyserve.sample.sampler import SamplingRow, SamplingTensors, sample
    from tinyserve.sampling_params import SamplingParams

    calls, fused = [], kernel.sample_race
    monkeypatch.setattr(kernel, "sample_race", lambda *a, **k: calls.append(1) or fused(*a, **k))

    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=50, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, seed=3),
    ] * 8
    rows = [
        SamplingRow(p, seed=i, prompt_ids=[1], output_ids=[2] * i) for i, p in enumerate(params)
    ]
    logits = torch.randn(len(rows), 4099, generator=torch.Generator().manual_seed(0)) * 3
    got = sample(logits.cuda(), SamplingTensors.build(rows, 4099, "cuda")).token_ids
    assert calls == [1], "sampled rows on CUDA take the fused kernel"
    want = sample(logits, SamplingTensors.build(rows, 4099, "cpu")).token_ids
    assert calls == [1] and torch.equal(got.cpu(), want)


@gpu
@pytest.mark.gpu
def test_greedy_takes_the_kernel_at_any_batch(monkeypatch):
    """tinyserve.sample.sampler.greedy on CUDA: the Triton argmax at every row count (faster
    than torch's reduction at 1-256 rows: BENCHMARKS.md), with torch's ids."""
    from tinyserve.kernels import sampling as kernel
    from tinyserve.sample.sampler import greedy

    calls, fused = [], kernel.argmax
    monkeypatch.setattr(kernel, "argmax", lambda *a, **k: calls.append(1) or fused(*a, **k))
    for rows, expected_calls in ((1, 1), (32, 2), (33, 3), (64, 4), (128, 5)):
        x = randn(rows, 151936, scale=4.0)
        assert torch.equal(greedy(x), x.argmax(-1))
        assert len(calls) == expected_calls, rows
