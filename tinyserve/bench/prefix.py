"""`bench.py prefix`: prefix caching on vs off over shared-prefix groups and prompts that share
nothing (--repeats fresh sets, medians over them), then the long-context run (long_context.py;
--long-budget 0 skips it). --small: the CPU sizes."""

from __future__ import annotations

from tinyserve.bench.common import SHAPES, pct, resolve_model
from tinyserve.bench.drive import as_served, drive, free_gpu
from tinyserve.bench.long_context import long_context


def bench_prefix(args) -> dict:
    """Shared-prefix groups with the cache on vs off, random prompts on vs off, and a long
    prompt arriving while streams decode (ITL p99 during its prefill, its TTFT vs alone).

    All requests arrive at once. `--max-num-seqs` (default 512, every request) keeps the
    sequence cap from binding, so concurrency is limited by KV capacity as in vLLM V1 on an
    80 GB card (its LLM default is 1024): with a cap of 256 the median of 512 TTFTs is the first
    request of the second wave, i.e. the decode time of the first wave, whatever the cache."""
    import random

    import torch

    from tinyserve import LLM, SamplingParams

    path, load_format = resolve_model(args.model)
    g, r, sys_len, q_len, out_len = 16, 32, 2048, 256, 128
    n_streams, long_len = 64, 32768
    if args.small:  # the CPU sizes: the groups and requests a group above, lengths / 4
        sys_len, q_len, out_len = 512, 64, 32
        n_streams, long_len = 8, 4096
    long_len = args.long_len or long_len
    rng = random.Random(0)
    cuda = torch.cuda.is_available()
    res = {"rows": [], "device": torch.cuda.get_device_name() if cuda else "cpu"}
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    vocab = 49152 if args.model not in SHAPES else SHAPES[args.model]["vocab_size"]

    def rand_ids(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def workloads(k: int) -> dict:
        systems = [rand_ids(sys_len) for _ in range(g)]
        shared = [
            (0.0, f"{k}g{i}r{j}", systems[i] + rand_ids(q_len), params)
            for j in range(r)
            for i in range(g)
        ]
        unique = [(0.0, f"{k}u{i}", rand_ids(sys_len + q_len), params) for i in range(g * r)]
        return {"shared_prefix": shared, "no_sharing": unique}

    # --repeats R: R fresh sets of each workload (new system prompts: no hit on an earlier set),
    # run in the same order on both engines; the row reports the median over the sets (0: the
    # long-context run only).
    sets = [workloads(k) for k in range(args.repeats)]
    rows = {
        name: {
            "workload": name,
            "requests": g * r,
            "prompt_len": sys_len + q_len,
            "output_len": out_len,
            "max_num_seqs": args.max_num_seqs,
            "repeats": args.repeats,
        }
        for name in ("shared_prefix", "no_sharing")
        if sets
    }
    for on in (True, False) if sets else ():
        llm = LLM(
            path,
            load_format=load_format,
            enable_prefix_caching=on,
            seed=0,
            max_num_seqs=args.max_num_seqs,
        )
        engine, tag = llm.engine, "on" if on else "off"
        # Warm-up: Triton compiles each kernel variant on first use (seconds on a fresh machine,
        # whose compile cache is empty); a shared head also compiles the cached-prefix paths.
        head = rand_ids(sys_len)
        warm = SamplingParams(temperature=0, max_tokens=4)
        drive(engine, [(0.0, f"warm{i}{tag}", head + rand_ids(q_len), warm) for i in range(3)])
        as_served(engine)
        res["kv_capacity_tokens"] = engine.kv_capacity_tokens
        for name, reqs in ((name, w[name]) for w in sets for name in w):
            row, trie = rows[name], engine.pool.trie
            q0, h0 = (trie.num_query_tokens, trie.num_hit_tokens) if trie else (0, 0)
            st = drive(engine, [(0.0, rid + tag, ids, p) for _, rid, ids, p in reqs])
            elapsed = st.pop("_elapsed")
            ttft = pct([s["times"][0] - s["arrival"] for s in st.values()], 0.5)
            row.setdefault(f"ttft_median_s_{tag}_sets", []).append(ttft)
            row.setdefault(f"tok_per_s_{tag}_sets", []).append(len(reqs) * out_len / elapsed)
            if trie:
                rate = (trie.num_hit_tokens - h0) / (trie.num_query_tokens - q0)
                row.setdefault("hit_rate_sets", []).append(rate)
                bs = engine.pool.block_size
                theory = (r - 1) * (sys_len // bs * bs) / (r * (sys_len + q_len))
                row["hit_rate_theory"] = theory if name == "shared_prefix" else 0.0
            engine.check_invariants()
        llm = engine = None
        free_gpu()
    for row in rows.values():
        for key in [k for k in row if k.endswith("_sets")]:
            row[key[: -len("_sets")]] = pct(row[key], 0.5)
        row["ttft_speedup"] = row["ttft_median_s_off"] / row["ttft_median_s_on"]
        row["throughput_ratio"] = row["tok_per_s_on"] / row["tok_per_s_off"]
        res["rows"].append(row)
        print(row, flush=True)
    if args.long_budget:  # 0: skip the long-context run
        row, res["long_context_timeline"] = long_context(
            path,
            load_format,
            args.long_budget,
            n_streams,
            long_len,
            rand_ids,
            args.lane_tokens,
            args.lane_reserve_sms,
        )
        res["rows"].append(row)
        print(row, flush=True)
    return res
