"""`bench.py structured`: what a JSON-schema constraint costs decode throughput, per --batches
value: B prompts of 32 tokens decoded under the schema, then the same prompts unconstrained with
each sequence's output length set to what it reached under the schema (a grammar may end a
sequence early), so the two runs do the same work and their ratio is the constraint's cost.

A grammar needs a tokenizer: --model is an HF directory with one, or a named shape (dummy
weights) with --tokenizer DIR (tokenizer.json + tokenizer_config.json; ids past its vocabulary
are never allowed). For the Qwen shapes, `python -m tinyserve.bench.qwen_vocab` writes one with
Qwen's own 151,643-token vocabulary: the mask fill's cost depends on the vocabulary, so a
smaller one padded to the logits' width misstates it. Runs on CUDA, or on the CPU for a smoke
run."""

from __future__ import annotations

import json
import os
import random
import shutil
import time

import torch

from tinyserve.bench.common import measure_ceilings, resolve_model

# Most of a JSON answer is string content: an object with free strings, an array, a number.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["answer", "notes", "score"],
}


def _model_dir(args) -> tuple[str, str]:
    path, load_format = resolve_model(args.model)
    if args.tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer, name), path)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        raise SystemExit("bench.py structured: the model has no tokenizer; pass --tokenizer DIR")
    return path, load_format


class _FillTimer:
    """Host seconds the engine spends filling grammar masks (`StepBitmask.fill`), and calls."""

    def __init__(self, engine) -> None:
        self.seconds, self.calls = 0.0, 0
        real = engine.constraints.bitmask.fill

        def fill(*a, **kw):
            t0 = time.perf_counter()
            out = real(*a, **kw)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out

        engine.constraints.bitmask.fill = fill


def _timed(llm, prompts, params, device) -> tuple[float, list[int]]:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]


def bench_structured(args) -> dict:
    from tinyserve import LLM, SamplingParams
    from tinyserve.sampling_params import StructuredOutputsParams

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, load_format = _model_dir(args)
    res = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": args.model,
        "tokenizer": args.tokenizer,
        "schema": SCHEMA,
        "ceilings": measure_ceilings(device) if device == "cuda" else None,
        "rows": [],
    }
    # No prefix caching: the second run of the same prompts would skip their prefill.
    llm = LLM(
        path,
        load_format=load_format,
        seed=0,
        max_num_seqs=max(args.batches),
        enable_prefix_caching=False,
    )
    engine = llm.engine
    timer = _FillTimer(engine)
    vocab = len(engine.tokenizer.backend.get_vocab())
    rng = random.Random(0)
    spec = StructuredOutputsParams(json=SCHEMA)

    def params(temperature, max_tokens, constrained, seed):
        return SamplingParams(
            temperature=temperature,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=True,
            structured_outputs=spec if constrained else None,
        )

    for temperature in args.temperatures:
        for b in args.batches:
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(32)] for _ in range(b)]
            # Warm-up: both paths compiled and the grammar cached before either is timed.
            warm = [p[::-1] for p in prompts]
            for constrained in (True, False):
                llm.generate(warm, params(temperature, 16, constrained, 0), use_tqdm=False)
            n = args.new_tokens
            json_params = [params(temperature, n, True, i) for i in range(b)]
            timer.seconds, timer.calls = 0.0, 0
            dt_json, lens = _timed(llm, prompts, json_params, device)
            fill_s, fill_calls = timer.seconds, timer.calls
            free_params = [params(temperature, max(1, m), False, i) for i, m in enumerate(lens)]
            dt_free, free_lens = _timed(llm, prompts, free_params, device)
            assert free_lens == [max(1, m) for m in lens], (free_lens, lens)
            r = {
                "workload": "json_schema",
                "seqs": b,
                "temperature": temperature,
                "out_tokens": sum(lens),
                "mean_out_len": sum(lens) / b,
                "out_tok_per_s_json": sum(lens) / dt_json,
                "out_tok_per_s_free": sum(free_lens) / dt_free,
                "mask_fill_ms_per_step": 1e3 * fill_s / max(1, fill_calls),
                "mask_fill_share": fill_s / dt_json,
            }
            r["cost"] = 1 - r["out_tok_per_s_json"] / r["out_tok_per_s_free"]
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
    return res
