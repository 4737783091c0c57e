"""`bench.py spec`: speculative decoding. CPU (default model): n-gram speculation on edit
prompts at batch 1 vs plain decode, outputs checked identical. GPU (--model mimo-7b): per batch,
MTP's step time with acceptance forced to 0..k vs plain decode (overhead and ceiling)."""

from __future__ import annotations

import json
import os
import time

import torch

from tinyserve.bench.common import SHAPES, resolve_model
from tinyserve.bench.drive import as_served, free_gpu, run_offline, steady_step_ms

EDIT_TEXTS = [
    "The quick brown fox jumpd over the lazy dog. It was a sunny day and the fox was very hapy. "
    "The dog did not care at all, it kept sleeping under the old oak tree near the river.",
    "Our team will meet on monday at 10 am to discus the new budjet. Please bring your laptops "
    "and the reports from last quarter, and send me any questions before the meeting.",
    "def add(a, b):\n    retrun a + b\n\ndef mul(a, b):\n    return a * b\n\nprint(add(2, 3))\n"
    "print(mul(4, 5))\n",
    "Water boils at 100 degres Celsius at sea level. At higher altitudes the air presure is "
    "lower, so water boils at a lower temperture and food takes longer to cook.",
]


def bench_spec(args) -> dict:
    """CPU (default model): n-gram speculation on edit prompts (the answer repeats the prompt) at
    batch 1 vs plain decode, outputs checked identical. GPU (--model mimo-7b): per batch size,
    the step time of MTP speculation with acceptance forced to 0 vs plain decode (the overhead),
    and tokens/s with acceptance forced to 0..k (the mechanism's ceiling)."""
    from tinyserve import LLM

    path, load_format = resolve_model(args.model)
    if load_format == "auto":
        return _spec_ngram_cpu(path, args)
    import random

    res = {"device": torch.cuda.get_device_name(), "model": args.model, "rows": []}
    vocab = SHAPES[args.model]["vocab_size"]
    rng = random.Random(0)
    new = args.new_tokens
    plain = {}
    runs = [(None, 0)] + [(k, v) for k in args.spec_k for v in args.draft_vocab]
    for k, draft_vocab in runs:
        spec = dict(speculative_method="mtp", num_speculative_tokens=k) if k else {}
        if draft_vocab:  # dummy weights: which ids make no difference to the cost
            spec["speculative_token_map"] = token_map = os.path.join(args.out, "token_map.json")
            os.makedirs(args.out, exist_ok=True)
            with open(token_map, "w") as f:
                json.dump(list(range(draft_vocab)), f)
        llm = LLM(path, load_format=load_format, seed=0, max_num_seqs=max(args.batches), **spec)
        # As served (cli.py freezes the start-up heap): full collections over an unfrozen heap
        # stalled the GPU for tens of ms inside these rows (docs/benchmark-log.md).
        as_served(llm.engine)
        for b in args.batches:
            n_in = args.prompt_len
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
            for f in range(k + 1) if k else [None]:
                llm.engine.config.spec_force_accept = f
                # Warm-up: first-use Triton compiles of this batch's eager shapes would land in
                # the first timed run and make its f look slower than the next. Past 64 keys,
                # so eager decode steps also meet a split count above one.
                warm = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
                temp = args.temperature
                run_offline(llm, warm, [min(new, 48)] * b, temp)  # other prompts: no prefix hits
                dt, n_out = run_offline(llm, prompts, [new] * b, temp)
                steps = -(-new // (f + 1)) if k else new
                again = [[rng.randrange(100, vocab - 100) for _ in range(n_in)] for _ in range(b)]
                r = {
                    "batch": b,
                    "prompt_len": n_in,
                    "k": k or 0,
                    "forced_accept": f,
                    "draft_vocab": draft_vocab or vocab,
                    "temperature": temp,
                    "out_tok_per_s": n_out / dt,
                    "step_ms": dt / steps * 1e3,  # the whole run (prefill included) per step
                    "steady_step_ms": steady_step_ms(llm, again, new, temp),
                }
                if not k:
                    plain[b] = r
                else:
                    r["step_vs_plain"] = r["step_ms"] / plain[b]["step_ms"]
                    r["steady_step_vs_plain"] = r["steady_step_ms"] / plain[b]["steady_step_ms"]
                    r["tok_per_s_vs_plain"] = r["out_tok_per_s"] / plain[b]["out_tok_per_s"]
                res["rows"].append(r)
                print(r, flush=True)
        del llm
        free_gpu()
    return res


def _spec_ngram_cpu(path: str, args) -> dict:
    from tinyserve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens)
    msgs = [
        [
            {
                "role": "user",
                "content": "Fix the typos in this text and repeat it in full, "
                f"changing nothing else.\n\n{t}",
            }
        ]
        for t in EDIT_TEXTS
    ]
    res = {"device": "cpu", "model": path, "rows": []}
    ref = None
    for k in [None, *args.spec_k]:
        spec = dict(speculative_method="ngram", num_speculative_tokens=k) if k else {}
        llm = LLM(path, device="cpu", **spec)
        llm.chat(msgs[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        t0, outs = time.perf_counter(), []
        for m in msgs:  # batch 1: one request at a time
            outs.append(llm.chat(m, params, use_tqdm=False)[0])
        dt = time.perf_counter() - t0
        ids = [o.outputs[0].token_ids for o in outs]
        if ref is None:
            ref = ids
        r = {
            "batch": 1,
            "method": "ngram" if k else "off",
            "k": k or 0,
            "out_tok_per_s": sum(map(len, ids)) / dt,
            "identical_to_plain": ids == ref,
        }
        if k:
            s = llm.engine.spec.stats
            r["acceptance"] = s.num_accepted_tokens / max(1, s.num_draft_tokens)
            r["mean_accepted_length"] = s.mean_accepted_length
            r["speedup"] = r["out_tok_per_s"] / res["rows"][0]["out_tok_per_s"]
        res["rows"].append(r)
        print(r, flush=True)
    return res
