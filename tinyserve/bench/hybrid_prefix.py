"""`bench.py hybrid-prefix`: the prefix cache of a hybrid model (Qwen3.5: a hit resumes from an
exact recurrent-state checkpoint) on vs off, a row per workload and cache setting: the hit rate
measured (`num_cached_tokens` over prompt tokens) and its ideal, TTFT median / p99, throughput
(output tokens over the run; decode_tok_per_s: those after the last request's first token).
Workloads (--prefix-workloads; GPU sizes, --small: the CPU ones in `SIZES`), all greedy with
fixed output lengths, every request (first turn) arriving at once:
  shared      16 groups x 32 requests: a 2,048-token system prompt per group + 256-token
              questions, 128 tokens out (prefix's shared_prefix). A third run keeps the cache
              but saves no decode checkpoints (prefix_cache_decode_state_interval=0): their cost
              is 1 - decode_tok_per_s(on) / decode_tok_per_s(on_no_decode_saves). Prompt chunk
              ends still save, so hits, TTFT and prefill work stay those of the "on" run and the
              decode steps differ by the saves (prefix_cache_state_budget=0 would not isolate
              them: it drops the checkpoint rows the hits use, and idle slots still take saves).
  multiturn   64 chats x 4 turns: turn 1 is a 200-500-token prompt; turn k+1 = turn k's prompt +
              its 128-token answer + a 50-125-token user message, sent when that answer ends.
  suffix      64 requests: one 2,048-token system prompt + 400-token distinct suffixes.
  suffix-mtp  suffix with MTP (num_speculative_tokens=1; a named shape's `-mtp` variant).
The ideal (hit_rate_theory, `ideal_hits`): a block-granular cache holding everything computed
before, with no eviction and no checkpoint constraint. The first request of a shared prompt pays
for it; a later one reuses floor(min(S, P - 1) / B) * B tokens of an S-token shared prompt (B the
block size, P its prompt length); a chat's turn k+1 reuses floor((P_k + O_k - 1) / B) * B of turn
k's prompt + answer (P_k + O_k tokens, the last sampled token has no KV). With MTP a block's key
also holds the token after it, so the block that ends a shared prompt is not reused."""

from __future__ import annotations

import random

from tinyserve.bench.common import SHAPES, pct, resolve_model
from tinyserve.bench.drive import as_served, drive, free_gpu
from tinyserve.model.config import ModelConfig

WORKLOADS = ("shared", "multiturn", "suffix", "suffix-mtp")
CACHE_RUNS = ("on", "on_no_decode_saves", "off")
# --small (the CPU) -> lengths in tokens, (lo, hi): drawn uniformly, and counts. 80 tokens out on
# the CPU: past the 4 decode blocks after a prompt's block (the default decode save interval).
SIZES = {
    False: dict(groups=16, group_size=32, system=2048, question=256, out=128)
    | dict(chats=64, turns=4, first=(200, 500), message=(50, 125), suffixes=64, suffix=400),
    True: dict(groups=4, group_size=8, system=256, question=32, out=80)
    | dict(chats=8, turns=3, first=(50, 125), message=(12, 32), suffixes=16, suffix=48),
}
# Engine runs: (cache setting, MTP, the workloads it runs), each a fresh engine, in this order
# (the decode saves' pair side by side).
# --cache-runs picks settings (a device call too short for all of them runs them apart).
RUNS = [
    ("on", False, ("shared", "multiturn", "suffix")),
    ("on_no_decode_saves", False, ("shared",)),
    ("off", False, ("shared", "multiturn", "suffix")),
    ("on", True, ("suffix-mtp",)),
    ("off", True, ("suffix-mtp",)),
]


def ideal_hits(reqs: list[tuple[list[int], list[int]]], bs: int, key_next: bool) -> list[int]:
    """The tokens of each prompt (in admission order: (prompt, output) pairs) that a block-granular
    cache of everything computed before could serve: the leading whole blocks equal to those of
    an earlier request's prompt + output, whose KV exists for all but the last token; never the
    prompt's last token (its logits are needed). `key_next` (MTP): a block's key also holds the
    token after it, as the trie's does (core/block_pool.py)."""
    seen: set[tuple[int, int]] = set()

    def keys(ids: list[int], num_blocks: int):
        h = 0
        for k in range(1, num_blocks + 1):
            h = hash((h, tuple(ids[(k - 1) * bs : k * bs])))
            yield h, ids[k * bs] if key_next else -1

    hits = []
    for prompt, output in reqs:
        num = 0
        for key in keys(prompt, (len(prompt) - 1) // bs):
            if key not in seen:
                break
            num += 1
        hits.append(num * bs)
        full = prompt + output
        seen.update(keys(full, (len(full) - 1) // bs))
    return hits


def workloads(size: dict, names, rand_ids, rng: random.Random) -> dict:
    """name -> (first prompts, each chat's later user messages or None)."""
    g, system, question = size["groups"], size["system"], size["question"]
    systems = [rand_ids(system) for _ in range(g)]
    shared = [systems[i] + rand_ids(question) for _ in range(size["group_size"]) for i in range(g)]
    lens = [rng.randint(*size["first"]) for _ in range(size["chats"])]
    messages = [
        [rand_ids(rng.randint(*size["message"])) for _ in range(size["turns"] - 1)]
        for _ in range(size["chats"])
    ]
    head = rand_ids(system)
    suffix = [head + rand_ids(size["suffix"]) for _ in range(size["suffixes"])]
    every = {
        "shared": (shared, None),
        "multiturn": ([rand_ids(n) for n in lens], messages),
        "suffix": (suffix, None),
        "suffix-mtp": (suffix, None),
    }
    return {name: every[name] for name in names}


def run_workload(engine, name: str, tag: str, prompts, messages, params) -> tuple[dict, int]:
    """One workload on `engine`: every first prompt at once; chat i's turn t + 1 (`messages`)
    sent when turn t finishes, its prompt turn t's prompt + answer + messages[i][t]. The
    requests' stats (drive) and the checkpoints saved meanwhile."""
    turn: dict[str, tuple[int, int, list[int]]] = {}  # rid -> (chat, turn, prompt)
    arrivals = []
    for i, ids in enumerate(prompts):
        turn[rid := f"{name}-{tag}-{i}-0"] = (i, 0, ids)
        arrivals.append((0.0, rid, ids, params))

    def then(rid: str, output: list[int]):
        i, t, prompt = turn[rid]
        if t >= len(messages[i]):
            return []
        ids = prompt + output + messages[i][t]
        turn[nxt := f"{name}-{tag}-{i}-{t + 1}"] = (i, t + 1, ids)
        return [(nxt, ids, params)]

    states = engine.scheduler.state_pool
    saves = getattr(states, "num_checkpoint_saves", 0)
    stats = drive(engine, arrivals, then if messages else None)
    return stats, getattr(states, "num_checkpoint_saves", 0) - saves


def row_of(engine, name: str, setting: str, stats: dict, num_saves: int, closed: bool) -> dict:
    elapsed = stats.pop("_elapsed")
    reqs = list(stats.values())  # admission order: first turns at once, later ones as sent
    bs, key_next = engine.pool.block_size, engine.pool.key_next_token
    ideal = ideal_hits([(s["prompt"], s["ids"]) for s in reqs], bs, key_next)
    num_prompt = sum(len(s["prompt"]) for s in reqs)
    num_out = sum(len(s["ids"]) for s in reqs)
    ttfts = [s["times"][0] - s["arrival"] for s in reqs]
    row = {
        "workload": name,
        "cache": setting,
        "requests": len(reqs),
        "prompt_tokens": num_prompt,
        "output_tokens": num_out,
        "hit_rate": sum(s["cached"] for s in reqs) / num_prompt,
        "hit_rate_theory": sum(ideal) / num_prompt,
        "ttft_median_s": pct(ttfts, 0.5),
        "ttft_p99_s": pct(ttfts, 0.99),
        "tok_per_s": num_out / elapsed,
        "checkpoint_saves": num_saves,
    }
    if not closed:  # decode: the tokens after every request's first, over their time
        start = max(s["times"][0] for s in reqs)
        times = [t for s in reqs for t in s["times"] if t > start]
        if times:
            row["decode_tok_per_s"] = len(times) / (max(times) - start)
    return row


def id_sampler(rng: random.Random, vocab: int):
    """n -> n random token ids, clear of a real vocabulary's special ids (a tiny one: all)."""
    lo = 100 if vocab > 1000 else 0
    return lambda n: [rng.randrange(lo, vocab - lo) for _ in range(n)]


def mtp_model(name: str | None) -> str | None:
    """A named Qwen3.5 shape's variant with an MTP layer (common.py); a directory as it is."""
    return f"{name}-mtp" if f"{name}-mtp" in SHAPES else name


def engine_kwargs(args, setting: str, mtp: bool) -> dict:
    kw: dict = dict(enable_prefix_caching=setting != "off")
    if setting != "off" and args.prefix_cache_state_budget is not None:
        kw["prefix_cache_state_budget"] = args.prefix_cache_state_budget
    if setting == "on_no_decode_saves":
        kw["prefix_cache_decode_state_interval"] = 0
    elif setting == "on" and args.prefix_cache_decode_state_interval is not None:
        kw["prefix_cache_decode_state_interval"] = args.prefix_cache_decode_state_interval
    if mtp:
        kw |= dict(speculative_method="mtp", num_speculative_tokens=1)
    return kw


def bench_hybrid_prefix(args) -> dict:
    """The runs of RUNS the chosen workloads need, each on a fresh engine with the same prompts
    (and chat messages); a row per workload and run, then each "on" row's ratios: TTFT speedup
    and throughput vs "off", and (shared) the decode saves' cost."""
    import torch

    from tinyserve import LLM, SamplingParams

    size = SIZES[args.small]
    params = SamplingParams(temperature=0, max_tokens=size["out"], ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4)
    rng = random.Random(0)
    cuda = torch.cuda.is_available()
    res = {"rows": [], "device": torch.cuda.get_device_name() if cuda else "cpu", "sizes": size}
    runs = [
        (s, mtp, [n for n in names if n in args.prefix_workloads])
        for s, mtp, names in RUNS
        if s in args.cache_runs
    ]
    runs = [run for run in runs if run[2]]
    paths = {mtp: resolve_model(mtp_model(args.model) if mtp else args.model) for _, mtp, _ in runs}
    if True in paths and ModelConfig.from_pretrained(paths[True][0]).num_nextn_predict_layers < 1:
        raise SystemExit(
            "bench.py hybrid-prefix: suffix-mtp needs MTP layers (a named shape, or a checkpoint "
            "with mtp_num_hidden_layers); leave it out with --prefix-workloads"
        )
    sets = None
    for setting, mtp, names in runs:
        path, load_format = paths[mtp]
        llm = LLM(
            path,
            load_format=load_format,
            seed=0,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **engine_kwargs(args, setting, mtp),
        )
        engine, tag = llm.engine, setting + "-mtp" * mtp
        rand_ids = id_sampler(rng, engine.model_config.vocab_size)
        if sets is None:  # drawn once: every run serves the same prompts
            sets = workloads(size, args.prefix_workloads, rand_ids, rng)
        # Warm-up: Triton compiles each kernel variant on first use; a shared head also
        # compiles the cached-prefix paths (and the checkpoint copies).
        head = rand_ids(size["system"])
        drive(
            engine, [(0.0, f"warm{i}", head + rand_ids(size["question"]), warm) for i in range(3)]
        )
        as_served(engine)
        for name in names:
            stats, num_saves = run_workload(engine, name, tag, *sets[name], params)
            row = row_of(engine, name, setting, stats, num_saves, sets[name][1] is not None)
            engine.check_invariants()
            res["rows"].append(row)
            print(row, flush=True)
        llm = engine = None
        free_gpu()
    by = {(r["workload"], r["cache"]): r for r in res["rows"]}
    for (name, setting), row in by.items():
        off, no_saves = by.get((name, "off")), by.get((name, "on_no_decode_saves"))
        if setting == "on" and off:
            row["ttft_speedup"] = off["ttft_median_s"] / row["ttft_median_s"]
            row["throughput_ratio"] = row["tok_per_s"] / off["tok_per_s"]
        if setting == "on" and no_saves and "decode_tok_per_s" in row:
            row["decode_save_cost"] = 1 - row["decode_tok_per_s"] / no_saves["decode_tok_per_s"]
    return res
