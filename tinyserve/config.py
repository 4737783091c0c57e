"""Engine configuration: `EngineConfig` holds the user's knobs (CLI flags and `LLM(**kwargs)`
map 1:1 onto its fields), checked on construction; a bad value raises `InvalidConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class InvalidConfig(ValueError):
    """An EngineConfig field has a bad value; `.param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_METHODS = (None, "mtp", "ngram")

# One engine step's token budget when none is given (`max_num_batched_tokens=None`), per device.
# Every running stream waits for the whole step, so a step must stay short wherever it runs; the
# budget bounds it (a decode row costs about what a prompt token does). On a GPU 8192 tokens take
# tens of ms. On the CPU, SmolLM2-135M in fp32 (the CPU default without AVX-512 BF16) computed a
# prompt at ~190 tokens per CPU-second in 256-token steps at short contexts, ~75 at a 4k context
# (attention then costs more than the matmuls), and a step costs ~0.2 CPU-s more whatever its
# size (the weights read, logits, sampling): a 64-token step takes ~0.45 CPU-s at short
# contexts and ~1.3 at 4k, a few hundred ms on two cores, where one 4k-token step (the old
# default) stalled every stream for ~40 s. Larger models on the CPU want a smaller budget (a
# step's cost grows with the parameters): pass one.
GPU_MAX_NUM_BATCHED_TOKENS = 8192
CPU_MAX_NUM_BATCHED_TOKENS = 64


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory; None = the default model (resolved by the engine)
    dtype: str = "auto"  # "auto" = derived from the checkpoint's torch_dtype by the engine
    max_model_len: int | None = None  # None = max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = per device (*_MAX_NUM_BATCHED_TOKENS)
    block_size: int = 16
    # None: on a GPU, sized from gpu_memory_utilization; on the CPU, from max_model_len and
    # max_num_seqs (runner/kv_cache.py states the rule).
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    seed: int = 0
    device: str | None = None  # None = "cuda" if available else "cpu"
    enable_prefix_caching: bool = True
    # Hybrid models: checkpoint rows for exact recurrent states at prefix-cache hit points,
    # beside idle runtime slots, which hold checkpoints too until an admission takes them
    # (None: max_num_seqs // 4, runner/states.py says why; 0: idle runtime slots only).
    prefix_cache_state_budget: int | None = None
    # Hybrid models: a decoding sequence saves its state at the end of the block its prompt
    # ends in, then every this many blocks (0: no decode saves; prompts still save at their
    # chunk ends). A saved block end is where the next chat turn (prompt + answer + new
    # message) resumes: 4 loses at most 3 blocks (48 tokens) of recompute a turn and copies a
    # quarter of the state bytes that saving every block does (~50 MiB a save on Qwen3.5-9B).
    prefix_cache_decode_state_interval: int = 4
    enforce_eager: bool = False  # True: no CUDA graphs (debugging, and the graphs-off test)
    # The overlapped step loop: step N+1 is launched before step N's tokens reach the host
    # (off, or automatically per step with speculation or penalties: one step at a time).
    # None: on with CUDA; off on the CPU, where the forward runs inside the launch, so the
    # overlap hides nothing and only hands each step's tokens out a step later.
    async_scheduling: bool | None = None
    speculative_method: str | None = None  # None (off), "mtp" or "ngram"
    num_speculative_tokens: int | None = None  # k drafts per step; required with a method
    # MTP only: a file of the token ids the head drafts from (spec/token_map.py).
    speculative_token_map: str | None = None
    # The prefill lane (prefill_lane.py): while others decode, a long prompt's chunks of this
    # many tokens run on a second stream beside the steps. None: 4096 with CUDA graphs on a
    # GPU that partitions its SMs (green contexts), else off; 0: off.
    prefill_lane_tokens: int | None = None
    prefill_lane_reserve_sms: int | None = None  # SMs the lane leaves free; None: by model size
    # Benchmark-only: accept exactly this many drafts per step whatever the target says (outputs
    # are then NOT the model's). Shows the mechanism's ceiling at a fixed acceptance.
    spec_force_accept: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidConfig("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidConfig(
                "load_format", f"{self.load_format!r} is not one of {', '.join(LOAD_FORMATS)}"
            )
        for name in ("max_num_seqs", "block_size"):
            _check_positive_int(name, getattr(self, name))
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "num_kv_blocks",
            "prefill_lane_reserve_sms",
        ):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        budget = self.prefix_cache_state_budget
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
        ):
            raise InvalidConfig("prefix_cache_state_budget", f"must be >= 0, got {budget!r}")
        interval = self.prefix_cache_decode_state_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise InvalidConfig(
                "prefix_cache_decode_state_interval", f"must be >= 0, got {interval!r}"
            )
        # Triton kernels tile a KV block with tl.arange, which needs a power of two.
        if self.block_size & (self.block_size - 1):
            raise InvalidConfig("block_size", f"must be a power of two, got {self.block_size}")
        lane = self.prefill_lane_tokens
        if lane is not None and lane != 0:
            _check_positive_int("prefill_lane_tokens", lane)
            if lane % self.block_size:
                raise InvalidConfig(
                    "prefill_lane_tokens", f"must be a multiple of block_size ({self.block_size})"
                )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidConfig(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidConfig(
                "speculative_method",
                f"{self.speculative_method!r} is not one of {', '.join(SPECULATIVE_METHODS[1:])}",
            )
        if self.speculative_method is None:
            if self.num_speculative_tokens is not None:
                raise InvalidConfig("num_speculative_tokens", "needs a speculative_method")
        else:
            if self.num_speculative_tokens is None:
                raise InvalidConfig("num_speculative_tokens", "is required with speculative_method")
            _check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.speculative_token_map is not None and self.speculative_method != "mtp":
            raise InvalidConfig("speculative_token_map", "applies to speculative_method 'mtp'")
        if self.spec_force_accept is not None:
            if self.speculative_method is None:
                raise InvalidConfig("spec_force_accept", "needs a speculative_method")
            if not isinstance(self.spec_force_accept, int) or not (
                0 <= self.spec_force_accept <= self.num_speculative_tokens
            ):
                raise InvalidConfig(
                    "spec_force_accept", "must be an integer in [0, num_speculative_tokens]"
                )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InvalidConfig("seed", f"must be an integer, got {self.seed!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise InvalidConfig("device", f"{self.device!r} is not a torch device") from e
        if self.async_scheduling is None:
            self.async_scheduling = device.type != "cpu"
        if self.max_num_batched_tokens is None:
            cpu = device.type == "cpu"
            self.max_num_batched_tokens = (
                CPU_MAX_NUM_BATCHED_TOKENS if cpu else GPU_MAX_NUM_BATCHED_TOKENS
            )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidConfig(name, f"must be a positive integer, got {value!r}")
