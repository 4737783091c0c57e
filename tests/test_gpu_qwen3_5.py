"""GPU (make test-gpu): Qwen3.5 through the engine on CUDA, tiny random checkpoints written by
transformers. CUDA graphs on vs off (decode graphs with state slots as inputs, padded rows on
the scratch slot, the overlapped loop) give the same greedy tokens, which in fp32 are
transformers'; n-gram and MTP speculation (verify graphs with per-token state slots as inputs,
the accepted state committed after the replay) too, MTP with prefix caching on."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from qwen3_5_helpers import add_mtp_weights, hf_greedy, make_checkpoint  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402

MAX_NEW = 24


@pytest.fixture(scope="module", params=[("lin_first_last", 0), ("small_vocab", 5)])
def checkpoint(request, tmp_path_factory):
    variant, seed = request.param
    path = tmp_path_factory.mktemp(variant)
    hf = make_checkpoint(path, variant, seed)
    add_mtp_weights(path, hf.model, seed + 1)
    vocab = hf.config.vocab_size
    rng = random.Random(seed)
    # 5 prompts: decode batches of 5 pad to a larger graph size (padded rows run too).
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 19, 33, 70)]
    want = [hf_greedy(hf, p, MAX_NEW)[len(p) :] for p in prompts]
    return str(path), prompts, want


def generate(path, prompts, **kw) -> list[list[int]]:
    llm = LLM(path, dtype="float32", seed=0, max_num_seqs=8, block_size=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    assert llm.engine.scheduler.state_pool.num_free_slots == 8
    if not kw.get("enforce_eager") and "speculative_method" not in kw:
        assert llm.engine.runner.graphs.num_replays > 0
    if not kw.get("enforce_eager") and kw.get("speculative_method") == "mtp":
        assert llm.engine.runner.verify_graphs.num_replays > 0
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_on_and_off_give_the_same_greedy_tokens(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, prompts, want = checkpoint
    eager = generate(path, prompts, enforce_eager=True, max_num_batched_tokens=32)
    graphs = generate(path, prompts, max_num_batched_tokens=32)
    overlap_off = generate(path, prompts, async_scheduling=False)
    assert graphs == eager
    assert overlap_off == eager
    assert eager == want  # fp32: transformers' tokens (near-ties aside, none on these seeds)


def test_ngram_speculation_on_cuda(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    path, prompts, _ = checkpoint
    plain = generate(path, prompts, enforce_eager=True)
    spec = generate(path, prompts, speculative_method="ngram", num_speculative_tokens=3)
    assert spec == plain


@pytest.mark.parametrize("force", [None, 2])
def test_mtp_verify_graphs_on_cuda(checkpoint, force):
    """MTP steps replay verify graphs (and their drafting graphs) with per-token state slots:
    greedy tokens as without speculation, and with acceptance forced, as the eager steps'."""
    torch.backends.cuda.matmul.allow_tf32 = False
    path, prompts, want = checkpoint
    kw = dict(speculative_method="mtp", num_speculative_tokens=2, spec_force_accept=force)
    kw |= dict(enable_prefix_caching=True)
    spec = generate(path, prompts + prompts[3:], **kw)
    if force is None:
        assert spec == want + want[3:]
    else:
        assert spec == generate(path, prompts + prompts[3:], enforce_eager=True, **kw)
