"""Shared by the test_gpu_*.py modules (CUDA only; they skip before importing this): model
directories in bench.py's real shapes, a transformers twin holding our dummy weights, spies on
the graphs' split counts, and step loops run under set_sync_debug_mode('error')."""

from __future__ import annotations

import gc
import json
import os
from types import SimpleNamespace

import torch

from bench import SHAPES
from tinyserve import LLM


def shape_dir(tmp_path, name: str, **override) -> str:
    cfg = {**SHAPES[name], **override}
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


def to_hf(llm, path: str, dtype: torch.dtype):
    """transformers model holding exactly our (dummy) weights, unpacked to HF names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = llm.engine.runner.model
    mc = llm.engine.model_config
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    sd = {}
    for name, p in model.named_parameters():
        if "qkv_proj" in name:
            for part, t in zip("qkv", p.split([q, kv, kv])):
                sd[name.replace("qkv_proj", f"{part}_proj")] = t
        elif "gate_up_proj" in name:
            gate, up = p.chunk(2)
            sd[name.replace("gate_up_proj", "gate_proj")] = gate
            sd[name.replace("gate_up_proj", "up_proj")] = up
        else:
            sd[name] = p
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return hf.eval()


def spy_split_counts(graphs) -> set:
    """The split counts (key[2]) of the graphs `graphs` replays from now on."""
    used = set()
    for key, graph in list(graphs.graphs.items()):
        graphs.graphs[key] = SimpleNamespace(
            replay=lambda key=key, graph=graph: (used.add(key[2]), graph.replay())
        )
    return used


def steps_without_sync(engine, strict, on_delta=None) -> dict[str, list[int]]:
    """Step the engine to the end; steps whose index is in `strict` (steady state: after prefill
    and warm-up, before the ends; or where `strict(index, engine)` is true) run under
    set_sync_debug_mode('error'), so any implicit device sync raises. Returns each request's
    tokens; `on_delta` sees every delta."""
    got: dict[str, list[int]] = {}
    for n in range(1000):
        if not engine.has_unfinished():
            break
        check = strict(n, engine) if callable(strict) else n in strict
        torch.cuda.set_sync_debug_mode("error" if check else "default")
        try:
            deltas = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for d in deltas:
            got.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
            if on_delta is not None:
                on_delta(d)
    assert not engine.has_unfinished()
    return got


def overlapped_and_synchronous(path, requests: dict, strict: range, graphs_ran, **kw) -> list:
    """Each request's tokens ({i: (prompt, params)}) from the overlapped loop, whose steps in
    `strict` run under set_sync_debug_mode('error'), then from the synchronous loop; every
    engine's invariants hold and `graphs_ran(engine)` is true."""
    outs = []
    for overlap in (True, False):
        llm = LLM(
            path, load_format="dummy", seed=0, num_kv_blocks=2048, async_scheduling=overlap, **kw
        )
        engine = llm.engine
        for i, (p, sp) in requests.items():
            engine.add_request(str(i), p, sp)
        outs.append(steps_without_sync(engine, strict if overlap else range(0)))
        engine.check_invariants()
        assert graphs_ran(engine)
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    return outs
