"""End-to-end engine behaviour on the real SmolLM2 (fp32, CPU) against transformers."""

from __future__ import annotations

import pytest
import torch

from tinyserve import LLM, InvalidParameter, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "東京は日本の首都です。",
    "Translate to French: I love programming because",
    "1, 2, 3, 4, 5,",
    "Q: Why is the sky blue?\nA:",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(ids) :].tolist()


def test_greedy_batch_matches_transformers(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.tokenizer
    # min_tokens masks EOS like transformers' min_new_tokens does, so both run 64 tokens
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
    outs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, ids, 64), prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    smollm2_llm.engine.check_invariants()


def test_mixed_batch_equals_each_alone(smollm2_llm):
    tok = smollm2_llm.tokenizer
    base = tok.encode(" ".join(PROMPTS))
    prompts = [base[(7 * i) % 40 : (7 * i) % 40 + 3 + (11 * i) % 60] for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, together):
        alone = smollm2_llm.generate([p], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    smollm2_llm.engine.check_invariants()


def test_preemption_gives_identical_outputs(smollm2_path, smollm2_llm):
    prompts = PROMPTS[:6]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = smollm2_llm.generate(prompts, params, use_tqdm=False)
    # 8 blocks of 8 tokens: one sequence fits, six do not -> preemption and recompute
    small = LLM(smollm2_path, dtype="float32", device="cpu", block_size=8, num_kv_blocks=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check_invariants()
    assert small.engine.pool.num_free_blocks == 8
    # a request that can never fit the pool is refused up front, not left to hang
    with pytest.raises(InvalidParameter, match="maximum context length"):
        small.generate([list(range(100))], SamplingParams(max_tokens=1), use_tqdm=False)


def test_chat_answers_paris(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends with <|im_end|>, not the length cap


def test_stop_strings_stop_ids_and_n(smollm2_llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = smollm2_llm.generate([PROMPTS[2]], greedy, use_tqdm=False)[0].outputs[0]
    word = full.text.split()[3]
    stopped = smollm2_llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=30, stop=[word]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == word
    assert word not in stopped.text and full.text.startswith(stopped.text)
    kept = smollm2_llm.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=30, stop=[word], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == stopped.text + word
    tid = full.token_ids[5]
    by_id = smollm2_llm.generate(
        [PROMPTS[2]],
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tid]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(tid) + 1]
    assert by_id.stop_reason == tid
    multi = smollm2_llm.generate(
        [PROMPTS[0]], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=3), use_tqdm=False
    )[0]
    assert [o.index for o in multi.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in multi.outputs}) > 1
    smollm2_llm.engine.check_invariants()


def test_seeded_sampling_reproducible_across_batches(smollm2_llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234)
    alone = smollm2_llm.generate([PROMPTS[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = smollm2_llm.generate(
        [PROMPTS[0], PROMPTS[3], PROMPTS[5]], [others, seeded, others], use_tqdm=False
    )
    assert mixed[1].outputs[0].token_ids == alone


def test_logprobs_are_consistent(smollm2_llm):
    out = smollm2_llm.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(max(lp.values()), abs=1e-5)  # greedy picks the top


@pytest.mark.parametrize("ids", [[1.5], ["7"], [-1], [49152], [10**30], [None], [[3]]])
def test_bad_token_ids_are_refused_with_nothing_queued(smollm2_llm, ids):
    with pytest.raises(InvalidParameter) as e:
        smollm2_llm.engine.add_request("bad", [5, 6, *ids])
    assert e.value.param == "prompt" and "[0, 49152)" in str(e.value)
    assert not smollm2_llm.engine.has_unfinished()


def test_token_ids_may_come_as_numpy_or_torch_integers(smollm2_llm):
    """A tokenizer's array (or tensor) of ids is taken as is: the same tokens as a list."""
    import numpy as np

    ids = [1, 4093, 314, 260, 1345]
    params = SamplingParams(temperature=0, max_tokens=4)
    want = smollm2_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids)):
        for outs in (
            smollm2_llm.generate([prompt], params, use_tqdm=False),
            smollm2_llm.generate(prompt, params, use_tqdm=False),
        ):
            assert outs[0].outputs[0].token_ids == want and outs[0].prompt_token_ids == ids
            assert all(type(t) is int for t in outs[0].prompt_token_ids)
    two = smollm2_llm.generate(np.array([ids, ids]), params, use_tqdm=False)  # a batch of rows
    assert [o.outputs[0].token_ids for o in two] == [want, want]


def test_invalid_requests_raise_typed_errors(smollm2_llm):
    with pytest.raises(InvalidParameter) as e:
        smollm2_llm.generate([[]], use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameter) as e:
        smollm2_llm.generate([[10**9]], use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameter) as e:
        smollm2_llm.generate(["hi"], SamplingParams(max_tokens=10**7), use_tqdm=False)
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidParameter) as e:
        smollm2_llm.generate(["hi"], SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    assert e.value.param == "logit_bias"
    assert not smollm2_llm.engine.has_unfinished()


def test_start_up_compiles_every_prefill_tile_one_pass_and_split(smollm2_llm, monkeypatch):
    """Each tile an eager step can take, in its one-pass and key-split variants: one left out
    would compile mid-step beside decoding streams and stall them all (BENCHMARKS.md)."""
    from tinyserve.kernels.prefill_attention import prefill_tiles
    from tinyserve.runner import warmup

    runner, launched = smollm2_llm.engine.runner, set()

    def record(*args, num_splits, block_m, block_n, num_warps, num_stages):
        launched.add(((block_m, block_n, num_warps, num_stages), num_splits))

    monkeypatch.setattr(warmup, "prefill_attention", record)
    monkeypatch.setattr(runner, "dtype", torch.bfloat16)  # two tiles (the GPU's bf16 choice)
    warmup.compile_prefill_attention(runner)
    tiles = prefill_tiles(torch.bfloat16, runner.device)
    assert len(tiles) == 2
    assert launched == {(tile, splits) for tile in tiles for splits in (1, 2)}


def test_warm_up_row_classes_take_every_matmul_variant(monkeypatch):
    """Each row count up to 256 takes the same gemv method and tiles at every model shape as one
    of the warm-up's ROW_CLASSES (the eager steps compile a class's variants with one count of
    it); a count whose choice no class shares would compile its kernel mid-run (Hopper rules:
    the tma kernel, 132 SMs)."""
    from tinyserve.kernels import gemv_config as gc
    from tinyserve.kernels._common import next_pow2
    from tinyserve.runner.warmup import ROW_CLASSES

    monkeypatch.setattr(gc, "_has_tma", lambda: True)
    monkeypatch.setattr(gc, "num_sms", lambda device: 132)
    monkeypatch.setattr(gc, "shared_memory", lambda device: 232448)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    shapes = [
        (6144, 4096),
        (4096, 4096),
        (22016, 4096),
        (4096, 11008),
        (4096, 8192),
        (32768, 4096),
        (151680, 4096),
        (28672, 4096),
        (4096, 14336),
        (4096, 1024),
        (1024, 2048),
        (6144, 1024),
        (1024, 3072),
        (151936, 1024),
    ]

    def tiles(method, m, n, k):
        if method in ("dot", "split"):
            return (gc.dot_config if method == "dot" else gc.split_config)(m, n, k, bf16, cpu)
        return gc.stream_config(m, n, k, cpu) if method == "stream" else None

    def choice(m):
        methods = [(gc.gemv_method(m, n, k), n, k) for n, k in shapes]
        return tuple(
            (
                meth,
                gc.silu_mul_epilogue(m, n, k),
                next_pow2(m),
                tiles(meth, m, n, k),
                meth in ("dot", "split") and gc.x_tile(m),
            )
            for meth, n, k in methods
        )

    warmed = {choice(m) for m in ROW_CLASSES}
    assert [m for m in range(1, 257) if choice(m) not in warmed] == []


def test_start_up_compiles_every_race_kernel_variant(smollm2_llm, monkeypatch):
    """The argmax, all rows sampled, and greedy rows among sampled ones: the graphs compile only
    what their captures run, so the first eager step with sampled rows compiled mid-run."""
    from tinyserve.kernels import sampling as kernel

    launched = []

    class Spy:  # kernel[grid](...) records the launch's flags instead of running it
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(
                (kwargs.get("HAS_GREEDY"), kwargs.get("SAMPLED"))
            )

    monkeypatch.setattr(kernel, "_race_chunk_kernel", Spy())
    monkeypatch.setattr(kernel, "_race_pick_kernel", Spy())
    from tinyserve.runner.warmup import compile_sampling

    compile_sampling(smollm2_llm.engine.runner)
    chunk_launches = {flags for flags in launched if flags != (None, None)}
    assert chunk_launches == {(False, False), (False, True), (True, True)}


@pytest.mark.parametrize("k", [0, 3])
def test_start_up_compiles_every_decode_kernel_variant(smollm2_llm, monkeypatch, k):
    """Each decode-kernel variant an eager step can take (a graph compiles only its padded
    size's): one pass or key splits, the short split's tile, a grid of at most two waves or
    more (the early fetch), at one query a row and, with k drafts, at the verify step's k + 1;
    and the merge's tile for up to 16, 32 and 64 splits."""
    from tinyserve.kernels._common import next_pow2, num_sms
    from tinyserve.runner import warmup
    from tinyserve.runner.graph_shapes import SHORT_SPLIT_BLOCK_N

    runner, kernels, merges = smollm2_llm.engine.runner, set(), set()
    kv_heads = runner.model_config.num_key_value_heads

    def record(q, k_cache, v_cache, table, lens, scale, *, num_splits, block_n, query_len):
        batch = q.shape[0] // query_len
        assert table.shape == (batch, 1) and (table == runner.num_kv_blocks).all()  # scratch
        assert lens.tolist() == [query_len] * batch
        waves = batch * kv_heads * num_splits > 2 * num_sms(q.device)
        kernels.add((query_len, num_splits > 1, block_n, waves))
        merges.add(max(16, next_pow2(num_splits)) if num_splits > 1 else None)

    monkeypatch.setattr(warmup, "decode_attention", record)
    monkeypatch.setattr(runner.config, "num_speculative_tokens", k)
    warmup.compile_decode_attention(runner)
    tiles = [(False, None), (True, None), (True, SHORT_SPLIT_BLOCK_N)]
    assert kernels >= {(q, s, n, w) for q in {1, k + 1} for s, n in tiles for w in (False, True)}
    assert merges == {None, 16, 32, 64}


@pytest.mark.parametrize(
    ("k", "eager", "steps"), [(0, False, False), (0, True, True), (2, False, True)]
)
def test_start_up_runs_eager_steps_where_steps_are_eager(smollm2_llm, monkeypatch, k, eager, steps):
    """`compile_start_up` runs the eager warm-up steps for speculative engines (through
    `compile_speculative`) and for engines without graphs (`enforce_eager`), not for plain
    engines whose decode steps replay graphs."""
    from tinyserve.runner import warmup

    runner, ran = smollm2_llm.engine.runner, []
    for name in ("compile_prefill_attention", "compile_decode_attention", "compile_sampling"):
        monkeypatch.setattr(warmup, name, lambda runner: None)
    monkeypatch.setattr(
        warmup, "compile_speculative", lambda runner: warmup.run_eager_steps(runner)
    )
    monkeypatch.setattr(warmup, "run_eager_steps", lambda runner: ran.append(runner))
    monkeypatch.setattr(runner.config, "num_speculative_tokens", k)
    monkeypatch.setattr(runner.config, "enforce_eager", eager)
    warmup.compile_start_up(runner)
    assert ran == ([runner] if steps else [])


def test_cpu_step_hands_out_its_own_tokens(smollm2_llm):
    """On the CPU the loop is synchronous by default: the step that computes a prompt returns
    its first token (the overlapped loop would hand it out one step later, with nothing gained:
    the CPU forward runs inside the launch)."""
    engine = smollm2_llm.engine
    engine.add_request("first", [1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    outs = engine.step()
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in outs] == [("first", 1)]
    while engine.has_unfinished():
        engine.step()
