"""GPU end to end (make test-gpu), speculative decoding: MTP and n-gram are lossless with
graphs on and off, the verify and drafting graphs draft as the eager pass does, and the
overlapped MTP loop does no hidden sync and compiles nothing after start-up."""

from __future__ import annotations

import gc
import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from gpu_helpers import overlapped_and_synchronous, shape_dir, spy_split_counts  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402


def test_speculative_decoding_is_lossless_and_verifies_in_graphs(tmp_path):
    """MTP and n-gram speculation (k = 3) give the greedy tokens of plain decoding (fp32), with
    CUDA graphs on and off; with graphs on, the verify steps replay the verify graphs."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    base = [(7 * j) % 900 + 100 for j in range(40)]
    prompts = [base[: 10 + 3 * i] + base[:12] for i in range(10)]  # repeats for n-gram hits
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(load_format="dummy", dtype="float32", seed=0, max_num_seqs=16, num_kv_blocks=2048)
    ref = [
        o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)
    ]
    for method in ("mtp", "ngram"):
        for eager in (False, True):
            llm = LLM(
                path, **kw, speculative_method=method, num_speculative_tokens=3, enforce_eager=eager
            )
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert got == ref, (method, eager)
            llm.engine.check_invariants()
            if not eager and method == "mtp":
                assert llm.engine.runner.verify_graphs.num_replays > 10
            del llm
            torch.cuda.empty_cache()


@pytest.mark.parametrize("token_map", [False, True])
def test_mtp_drafts_from_the_verify_graph_equal_eager_drafts(tmp_path, token_map):
    """The drafting graph replayed after a verify graph proposes what the eager MTP pass does
    (fp32; a split-count difference in the chained attention may flip a rare near-tie). The
    verify graphs take the split count of the context (12 to ~80 keys: 1 and 4), and the one
    drafting graph of a size reads the hidden states of whichever ran. With a token map, the
    graphs draft its ids only."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    spec = {}
    if token_map:
        hot = list(range(151_679, 0, -5))
        (tmp_path / "map.json").write_text(json.dumps(hot))
        spec["speculative_token_map"] = str(tmp_path / "map.json")
    prompts = [[(13 * i + 5 * j) % 900 + 100 for j in range(12 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seen = []
    for eager in (False, True):  # the synchronous loop: the host holds the drafts
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=8,
            num_kv_blocks=2048,
            speculative_method="mtp",
            num_speculative_tokens=3,
            enforce_eager=eager,
            async_scheduling=False,
            **spec,
        )
        engine, drafts = llm.engine, []
        splits = set() if eager else spy_split_counts(engine.runner.verify_graphs)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        while engine.has_unfinished():
            engine.step()
            drafts.append(sorted((s.seq_id, tuple(s.draft_ids)) for s in engine.scheduler.running))
        if not eager:
            assert engine.runner.verify_graphs.num_replays > 10
            assert {1, 4} <= splits, splits
        seen.append(drafts)
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    assert len(seen[0]) == len(seen[1])
    same = sum(a == b for a, b in zip(*seen))
    assert same >= 0.9 * len(seen[0]), (same, len(seen[0]))
    if token_map:
        ids = {t for step in seen[0] + seen[1] for _, d in step for t in d}
        assert len(ids) > 5 and ids <= set(hot)


def test_verify_steps_take_the_split_k_decode_kernel(tmp_path, monkeypatch):
    """Eager MTP verify steps (k = 3) attend through decode_attention with query_len 4 (split-K
    over the context), not the prefill kernel; their greedy tokens are speculation-off's."""
    from tinyserve.model.layers import attention as layer

    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    query_lens = []
    real = layer.decode_attention

    def spy(*args, query_len=1, **kwargs):
        query_lens.append(query_len)
        return real(*args, query_len=query_len, **kwargs)

    monkeypatch.setattr(layer, "decode_attention", spy)  # the name the layer calls
    prompt = [(7 * j) % 900 + 100 for j in range(300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for spec in ({}, {"speculative_method": "mtp", "num_speculative_tokens": 3}):
        llm = LLM(
            path,
            load_format="dummy",
            dtype="float32",
            seed=0,
            max_num_seqs=4,
            enforce_eager=True,
            **spec,
        )
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
    assert 4 in query_lens


@pytest.mark.parametrize(("force", "temperature"), [(None, 0), (None, 0.8), (2, 0), (2, 0.8)])
def test_overlapped_mtp_loop_has_no_hidden_sync_and_same_outputs(tmp_path, force, temperature):
    """MTP verify steps overlap: the next step's last token, drafts, positions and (seeded
    sampling) RNG counters come from the step in flight on the device. Steady-state steps run
    under set_sync_debug_mode('error') and give the synchronous loop's tokens (forced
    acceptance: every step moves positions and counters). Sampled rows read the accepted
    counts of the step in flight after their own verify replay: those counts must not sit in
    memory the replay reuses (free acceptance diverged at the second verify step)."""
    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=4,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    prompts = [[(13 * i + 5 * j) % 900 + 100 for j in range(12 + 5 * i)] for i in range(6)]
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=60, ignore_eos=True)
    outs = overlapped_and_synchronous(
        path,
        {i: (p, params) for i, p in enumerate(prompts)},
        range(3, 10),
        lambda engine: engine.runner.verify_graphs.num_replays > 8,
        dtype="float32",
        max_num_seqs=8,
        speculative_method="mtp",
        num_speculative_tokens=3,
        spec_force_accept=force,
    )
    if force is None:
        assert outs[0] == outs[1]
    else:  # the overlapped loop drafts less in the last steps (a step in flight may accept)
        assert all(outs[0][r][:-10] == outs[1][r][:-10] for r in outs[1])


@pytest.mark.parametrize("force", [0, 1])
def test_mtp_steps_after_start_up_compile_no_kernel(tmp_path, force):
    """MTP verify steps after start-up, greedy and sampled, at batch sizes 1-9 and contexts
    past 256 tokens, compile no Triton kernel (a compile stalls every stream: BENCHMARKS.md).
    Eager drafting, the accept and shift kernels and every decode tile are compiled by
    `tinyserve.runner.warmup`; test_gpu_overlap.py's `test_steps_after_start_up_compile_no_kernel`
    covers plain steps on short prompts."""
    from triton import knobs

    path = shape_dir(
        tmp_path,
        "mimo-7b",
        num_hidden_layers=2,
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    llm = LLM(
        path,
        load_format="dummy",
        seed=0,
        max_num_seqs=16,
        speculative_method="mtp",
        num_speculative_tokens=1,
        spec_force_accept=force,
    )
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(
        (kw["fn"].name, kw["compile"]["constants"])
    )
    try:
        kinds = [
            SamplingParams(temperature=0, max_tokens=260, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=3, max_tokens=240, ignore_eos=True),
        ]
        for batch in (1, 2, 5, 9):
            prompts = [
                [(7 * i + 3 * j) % 900 + 100 for j in range(32 + 9 * i)] + [batch]
                for i in range(batch)
            ]
            llm.generate(prompts, [kinds[i % 2] for i in range(batch)], use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [], sorted({name for name, _ in compiled})
