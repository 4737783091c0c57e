"""GPU end to end (make test-gpu), model numerics: Triton kernels + CUDA graphs against
transformers on the same dummy weights in real shapes, and switches of the fused paths
(PDL, split-K sums in the norms, float32 LM-head accumulators) that must change no bit."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from gpu_helpers import shape_dir, to_hf  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_logits_and_greedy_match_transformers(tmp_path, name):
    torch.backends.cuda.matmul.allow_tf32 = False
    path = shape_dir(tmp_path, name, num_hidden_layers=8, max_position_embeddings=4096)
    llm = LLM(path, load_format="dummy", dtype="float32", seed=0, max_num_seqs=8)
    hf = to_hf(llm, path, torch.float32)
    prompts = [[(37 * i + 11 * j) % 5000 + 100 for j in range(20 + 7 * i)] for i in range(4)]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0, -1].float()
    got = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, logprobs=1), use_tqdm=False
    )
    first = got[0].outputs[0]
    ref_lp = torch.log_softmax(ref, -1)
    assert abs(first.logprobs[0][first.token_ids[0]] - ref_lp.max().item()) < 2e-3
    # Alone, the prompt decodes at batch 1: the fused gemv prologues (norm, SiLU) and the
    # rope_store_kv kernel run there, so they are checked against transformers too.
    alone = llm.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for p, out in zip(prompts + prompts[1:2], got + alone):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == want[0, len(p) :].tolist()
    llm.engine.check_invariants()


def test_mixed_batches_with_shared_prefixes_match_transformers(tmp_path, monkeypatch):
    """64-token budgets interleave prompt chunks (some after prefix-cache hits) with decode
    rows in one forward, then decode steps share prefixes: greedy = transformers."""
    import tinyserve.runner.model_runner as runner_module

    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=4, max_position_embeddings=4096)
    llm = LLM(
        path,
        load_format="dummy",
        dtype="float32",
        seed=0,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=True,
    )
    mixed = []
    prepare = runner_module.build_host_inputs

    def spy(*args):
        h = prepare(*args)
        mixed.append(1 in h.q_lens and max(h.q_lens) > 1)
        return h

    monkeypatch.setattr(runner_module, "build_host_inputs", spy)
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = to_hf(llm, path, torch.float32)
    head = [(7 * j) % 4000 + 50 for j in range(200)]
    prompts = [head + [(31 * i + j) % 3000 + 60 for j in range(5 + 9 * i)] for i in range(10)]
    got = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert sum(mixed) >= 5 and llm.engine.runner.graphs.num_shared_replays >= 1
    for p, out in zip(prompts, got):
        with torch.inference_mode():
            want = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == want[0, len(p) :].tolist()
    llm.engine.check_invariants()


def test_lm_head_writes_float32_accumulators(monkeypatch):
    """Above 64 rows (Qwen3's vocabulary) the LM head is cuBLAS writing float32 (torch >= 2.8):
    logits as exact as a float32 matmul of the same bf16 operands, into `out` or a new tensor;
    older torch (the fallback) rounds them to bf16 first, as HF's logits.float() does."""
    import torch.nn.functional as F

    from tinyserve.model.layers import embedding

    torch.manual_seed(0)
    head = embedding.LMHead(151936, 1024).cuda().to(torch.bfloat16)
    head.weight.normal_(0, 0.02)
    x = torch.randn(96, 1024, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ head.weight.float().t()
    for out in (None, torch.empty(96, 151936, device="cuda")):
        got = head(x, out)
        assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 1e-3
    monkeypatch.setattr(embedding, "_MM_FLOAT_OUT", False)
    assert torch.equal(head(x), F.linear(x, head.weight).float())


def test_pdl_on_off_identical(tmp_path, monkeypatch):
    """Programmatic dependent launch only changes when kernels are scheduled: greedy outputs
    with it off equal those with it on, at batch 1 (fused decode kernels) and batch 12."""
    path = shape_dir(tmp_path, "qwen3-0.6b", num_hidden_layers=8, max_position_embeddings=4096)
    prompts = [[(13 * i + j) % 3000 + 50 for j in range(10 + 5 * i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("TINYSERVE_PDL", flag)
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=16, num_kv_blocks=512)
        runs = [
            llm.generate(prompts[:1], params, use_tqdm=False),
            llm.generate(prompts, params, use_tqdm=False),
        ]
        outs.append([o.outputs[0].token_ids for run in runs for o in run])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def test_split_k_sums_in_the_norms_change_no_bit(tmp_path, monkeypatch):
    """At 33-128 rows a 7-8B model's o and down projections run split-K and hand their partials
    unsummed to the next norm (or the last add), also past 64 rows, where the down projection
    follows a cuBLAS gate_up and its own SiLU (`Linear.gated`): greedy tokens and logprobs equal
    those of summing them in the projections (decode steps of 96, then 48 rows, in graphs)."""
    from tinyserve.kernels.gemv import SplitSum
    from tinyserve.model.layers.linear import Linear

    path = shape_dir(tmp_path, "llama-3.1-8b", num_hidden_layers=2, max_position_embeddings=4096)
    prompts = [[(29 * i + 7 * j) % 20000 + 100 for j in range(3 + i % 5)] for i in range(96)]
    params = [
        SamplingParams(temperature=0, max_tokens=6 + 6 * (i % 2), logprobs=2, ignore_eos=True)
        for i in range(96)
    ]
    deferred, gated = [], []
    split_gated = Linear.gated
    unreduced = Linear.unreduced

    def spy(self, x):
        y = unreduced(self, x)
        deferred.append(isinstance(y, SplitSum))
        return y

    def gated_spy(self, x):
        y = split_gated(self, x)
        gated.append(isinstance(y, SplitSum))
        return y

    runs = []
    for patch in (spy, Linear.forward):
        monkeypatch.setattr(Linear, "unreduced", patch)
        monkeypatch.setattr(Linear, "gated", gated_spy)
        llm = LLM(path, load_format="dummy", seed=0, max_num_seqs=128)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert any(deferred) and any(gated)
    assert runs[0] == runs[1]
