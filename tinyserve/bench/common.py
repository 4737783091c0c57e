"""What every benchmark shares: the commit and machine ceilings a result records, a timer,
percentiles, and the benchmark models (`SHAPES`: published HF configs, run with dummy weights).
Imports torch but no CUDA at import time; `measure_ceilings("cuda")` needs a device."""

from __future__ import annotations

import json
import os
import subprocess
import time

import torch


def git_commit() -> str:
    """HEAD's short hash, or $TINYSERVE_COMMIT (a tree copied without .git: the GPU machine's)."""
    if commit := os.environ.get("TINYSERVE_COMMIT"):
        return commit
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def measure_ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written) and GEMM rate in fp32 and bf16 on this device."""
    n = 1 << 30  # bytes: far larger than any cache
    a = torch.randn(n // 4, device=device)
    b = torch.empty_like(a)
    best = min(timed(lambda: b.copy_(a), device) for _ in range(5))
    res = {"copy_GBps": 2 * n / best / 1e9}
    size = 1024 if device == "cpu" else 8192
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(size, size, device=device, dtype=dt)
        t = min(timed(lambda x=x: x @ x, device) for _ in range(3))
        res[f"gemm_{str(dt)[6:]}_GFLOPs"] = 2 * size**3 / t / 1e9
    return res


def timed(fn, device: str) -> float:
    """Seconds one fn() call takes, the device synchronized on both sides."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank; NaN when empty)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


_QWEN3_5 = dict(  # what the Qwen3.5 dense sizes share
    architectures=["Qwen3_5ForCausalLM"],
    model_type="qwen3_5_text",
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    full_attention_interval=4,
    vocab_size=248320,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25),
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    torch_dtype="bfloat16",
)

SHAPES = {  # published HF configs of the benchmark models, for dummy weights in real shapes
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=5e5,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=5e5,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1e6,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        torch_dtype="bfloat16",
    ),
    # XiaomiMiMo/MiMo-7B-RL: a Qwen2 body with one MTP layer
    "mimo-7b": dict(
        architectures=["MiMoForCausalLM"],
        model_type="mimo",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=151680,
        tie_word_embeddings=False,
        rope_theta=640000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=1,
        attention_bias=True,
        torch_dtype="bfloat16",
    ),
    # Qwen/Qwen3.5-0.8B and -9B text models: [3 x Gated DeltaNet, 1 x gated attention] repeated
    "qwen3.5-0.8b": dict(
        _QWEN3_5,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3.5-9b": dict(
        _QWEN3_5,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
    ),
}

# The Qwen3.5 shapes with one MTP layer (`mtp_num_hidden_layers: 1`): dummy loading then builds
# its weights, which speculative_method="mtp" needs (the shapes above have none: refused).
SHAPES |= {
    f"{n}-mtp": dict(SHAPES[n], mtp_num_hidden_layers=1) for n in ("qwen3.5-0.8b", "qwen3.5-9b")
}


def resolve_model(name: str | None) -> tuple[str, str]:
    """(directory, load_format): a named shape becomes a config-only directory with dummy
    weights and no tokenizer (prompts are token ids); anything else is an HF directory."""
    if name in SHAPES:
        import tempfile

        path = tempfile.mkdtemp(prefix=f"tinyserve-{name}-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(SHAPES[name], f)
        return path, "dummy"
    from tinyserve.model.gguf import default_model_path

    return name or default_model_path(), "auto"
