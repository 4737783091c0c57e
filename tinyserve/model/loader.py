"""Builds a model on its device and fills it from safetensors (or with seeded dummy weights).

One generic loop maps each checkpoint tensor to (parameter, shard) through the model's
`packed_modules_mapping` and the parameter's `weight_loader`. Afterwards every parameter, and
every shard of a packed one, has been written exactly once; anything else raises
`CheckpointError` naming the tensor. Safetensors only (no pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from tinyserve.model.config import ModelConfig
from tinyserve.model.layers.linear import ShapeMismatch, default_weight_loader
from tinyserve.model.layers.norm import RMSNorm
from tinyserve.model.models.llama import LlamaForCausalLM
from tinyserve.model.models.mtp import LAYOUTS, MTPHead, detect_layout, map_mtp_name
from tinyserve.model.models.qwen3_5 import Qwen3_5ForCausalLM


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model (missing, extra, duplicated, bad shape)."""


class CheckpointNotFound(FileNotFoundError):
    """The model directory has no model.safetensors nor model.safetensors.index.json."""


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    with_mtp: bool = False,
) -> LlamaForCausalLM:
    """`with_mtp` also builds and loads the checkpoint's MTP layers (else they are skipped)."""
    device = torch.device(device)
    # Parameters are torch.empty (no init kernels) and created directly on the device in the
    # target dtype, so nothing is allocated twice. (Meta + to_empty would also work but would
    # wipe the precomputed RoPE table, a buffer.)
    with _default_dtype(dtype), device:
        if config.layer_types:  # a hybrid model (Qwen3.5)
            model = Qwen3_5ForCausalLM(config)
        else:
            model = LlamaForCausalLM(config)
        if with_mtp:
            model.mtp = MTPHead(config, model)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        load_weights(model, checkpoint_files(config.path))
    else:
        raise ValueError(f"load_format {load_format!r} is not one of auto, dummy")
    return model.eval()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def checkpoint_files(path: str) -> list[str]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    elif os.path.isfile(single):
        files = [single]
    else:
        raise CheckpointNotFound(
            f"no model.safetensors or model.safetensors.index.json in {path!r}"
        )
    for file in files:
        if not os.path.isfile(file):
            raise CheckpointNotFound(f"checkpoint shard {file!r} listed in the index is missing")
    return files


def _skipped(name: str, model: LlamaForCausalLM) -> bool:
    """Checkpoint tensors that are dropped on purpose (all others must map to a parameter)."""
    if name.endswith("rotary_emb.inv_freq"):  # buffer saved by old transformers; we recompute it
        return True
    if name.startswith("model.visual."):  # a multimodal checkpoint's vision tower: not built
        return True
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def _target(name: str, mapping: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    """'model.layers.0.self_attn.k_proj.weight' -> ('model.layers.0.self_attn.qkv_proj.weight',
    'k'); unpacked names map to themselves with shard None."""
    for ckpt_module, (packed_module, shard_id) in mapping.items():
        if f".{ckpt_module}." in name:
            return name.replace(f".{ckpt_module}.", f".{packed_module}."), shard_id
    return name, None


def load_weights(model: LlamaForCausalLM, files: list[str]) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    expected = {
        (name, shard) for name, p in params.items() for shard in getattr(p, "shard_ids", (None,))
    }
    written: dict[tuple[str, str | int | None], str] = {}  # (param, shard) -> checkpoint name
    names = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names += f.keys()
    layout = detect_layout(names, model.config)
    if model.mtp is not None:
        if layout is None:
            raise CheckpointError("the checkpoint has no MTP weights (speculative method mtp)")
        model.mtp.layout = LAYOUTS[layout]
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if _skipped(ckpt_name, model):
                    continue
                name = ckpt_name
                if name.startswith("model.language_model."):  # a multimodal checkpoint's text
                    name = "model." + name.removeprefix("model.language_model.")
                mapped = map_mtp_name(name, layout, model.config) if layout else None
                if mapped is not None:  # an MTP tensor
                    if mapped == "" or model.mtp is None:
                        continue  # not drafting, or the layer's copy of a shared weight
                    name = mapped
                key = _target(name, model.packed_modules_mapping)
                if key not in expected:
                    raise CheckpointError(f"unexpected tensor {ckpt_name!r} in the checkpoint")
                if key in written:
                    raise CheckpointError(
                        f"tensor {ckpt_name!r} appears twice (already loaded from {written[key]!r})"
                    )
                param = params[key[0]]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    # CPU (mmap) tensor in the file's dtype; copy_ casts and moves it in one go.
                    weight_loader(param, f.get_tensor(ckpt_name), key[1])
                except ShapeMismatch as e:
                    raise CheckpointError(
                        f"tensor {ckpt_name!r} has shape {e.got}, the model expects {e.expected}"
                    ) from None
                written[key] = ckpt_name
    if layout is not None and model.mtp is not None and model.mtp.layout.zero_centred_norms:
        with torch.no_grad():
            for m in model.mtp.modules():  # (ZeroCentredRMSNorms add the 1 as they load)
                if type(m) is RMSNorm:
                    m.weight += 1.0  # Qwen3-Next stores w for a (1 + w) scale
    missing = expected - written.keys()
    if missing:
        names = sorted(
            _source(name, shard, model.packed_modules_mapping) for name, shard in missing
        )
        raise CheckpointError(f"checkpoint lacks tensors: {', '.join(names)}")


def _source(name: str, shard: str | int | None, mapping: dict[str, tuple[str, str | int]]) -> str:
    """Inverse of _target: the checkpoint name that should have filled (name, shard)."""
    for ckpt_module, (packed_module, shard_id) in mapping.items():
        if shard is not None and shard == shard_id and f".{packed_module}." in name:
            return name.replace(f".{packed_module}.", f".{ckpt_module}.")
    return name


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights in the real shapes, for benchmarks and tests without a checkpoint.

    Matrices (linears, embedding, lm head) ~ N(0, 1/fan_in) with fan_in = the last dim: each
    projection then keeps the RMS of its input, so the residual stream grows only like
    sqrt(num_layers) and logits stay O(1) (softmax is neither flat nor one-hot). Norm weights are
    1 and biases 0, as at the start of training. Draws run on the model's device from one
    generator in named_parameters() order: same seed and device -> same weights.
    """
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for _, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:
            param.zero_()
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
