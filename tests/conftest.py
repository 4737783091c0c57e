"""Shared fixtures: the real SmolLM2 checkpoint (converted once per test run) and its oracle;
the tiny random checkpoints of the engine-loop tests (Llama: `model_dir`; MiMo with an MTP head:
`mimo_dir`, with its plain greedy `reference`); a seeded torch RNG for the kernel tests."""

from __future__ import annotations

import json
import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory) -> str:
    from tinyserve.model.gguf import default_model_path

    if "TINYSERVE_CACHE_DIR" not in os.environ:  # reuse the user's cache when it exists
        default = os.path.expanduser("~/.cache/tinyserve")
        if not os.path.isdir(default):
            os.environ["TINYSERVE_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from tinyserve import LLM

    return LLM(smollm2_path, dtype="float32", device="cpu", seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random Llama of the overlapped-loop, graph and prefill-lane tests
    (overlap_helpers.CONFIG): a config.json, loaded with dummy weights."""
    from overlap_helpers import CONFIG

    path = tmp_path_factory.mktemp("llama")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    """The tiny random MiMo of the speculative-decoding tests (spec_helpers.CONFIG)."""
    from spec_helpers import CONFIG

    path = tmp_path_factory.mktemp("mimo")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def reference(mimo_dir):
    """The tiny MiMo's greedy outputs for spec_helpers.prompts(), without speculation."""
    from spec_helpers import make_llm, prompts, run

    return run(make_llm(mimo_dir), prompts())


@pytest.fixture
def seed_torch():
    """torch's global RNG seeded with 0: the kernel tests draw their random inputs from it
    (`pytestmark` of each test_kernels_*.py), so a failing test reproduces when run alone."""
    torch.manual_seed(0)
