"""Shared by test_overlap.py, test_graphs.py and test_prefill_lane.py: a tiny random Llama
(CPU, fp32, dummy weights), an LLM factory, a mixed workload and its outputs with the engine's
invariants checked. The checkpoint directory is conftest's `model_dir` fixture."""

from __future__ import annotations

import random

from tinyserve import LLM, SamplingParams

VOCAB = 128
CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    torch_dtype="float32",
    eos_token_id=7,
)


def make_llm(path, **kw):
    """The overlapped loop unless a test says otherwise (on the CPU it is off by default)."""
    kw = (
        dict(
            dtype="float32",
            device="cpu",
            load_format="dummy",
            seed=5,
            block_size=4,
            num_kv_blocks=256,
            async_scheduling=True,
        )
        | kw
    )
    return LLM(path, **kw)


def workload(seed: int = 0):
    """Mixed lengths and limits, shared heads (prefix hits), EOS stops, stop ids, seeded
    sampling, logprobs and min_tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(8, VOCAB) for _ in range(10)]
    prompts, params = [], []
    for i in range(12):
        prompts.append(
            head[: rng.randrange(11)]
            + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 20))]
        )
        kind = i % 4
        params.append(
            SamplingParams(
                temperature=0 if kind < 2 else 0.9,
                seed=i if kind >= 2 else None,
                max_tokens=rng.randrange(1, 30),
                ignore_eos=kind == 0,
                stop_token_ids=[rng.randrange(8, VOCAB)] if kind == 1 else [],
                logprobs=2 if kind == 3 else None,
                min_tokens=3 if kind == 2 else 0,
            )
        )
    return prompts, params


def outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_invariants()
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs
    ]
