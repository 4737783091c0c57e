"""Shared fixtures: the real SmolLM2 checkpoint (converted once per session) and its oracle."""

from __future__ import annotations

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
