"""lm-eval's `local-completions` model against a real `tinyserve run`: a loglikelihood
(multiple-choice) task and a generate_until task, each a few items from local JSONL files, run
end to end through lm_eval.simple_evaluate (echo + logprobs for the first, stop strings for the
second). The tokenizer lm-eval loads is the served model's HF directory, which the server prints
at start. Skipped without lm_eval (`pip install lm-eval[api]`)."""

from __future__ import annotations

import json
import math
import re
import select
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its `api` extra

pytestmark = pytest.mark.slow

MULTIPLE_CHOICE = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " a banana", " purple"],
        "gold": 0,
    },
    {"question": "Two plus two equals", "choices": [" seven", " four", " the sky"], "gold": 1},
    {"question": "The sun rises in the", "choices": [" cupboard", " fridge", " east"], "gold": 2},
    {"question": "Water is made of hydrogen and", "choices": [" oxygen", " cheese"], "gold": 0},
]
GENERATE = [
    {
        "question": "Q: What is the capital of France?\nA:",
        "answer": " The capital of France is Paris",
    },
    {"question": "Q: What colour is the sky on a clear day?\nA:", "answer": " It is blue"},
]
TASKS = """\
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
metadata:
  version: 1.0
---
task: tiny_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/generate.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


class Server:
    """`tinyserve run` on a free port, its log in a file (a pipe no one reads would fill up);
    `url` once it says where it serves, the rest of its stdout left to read."""

    def __init__(self, tmp, *args: str) -> None:
        exe = shutil.which("tinyserve")
        cmd = [exe] if exe else [sys.executable, "-m", "tinyserve.cli"]
        self.log_path = tmp / "server.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, "run", "--port", "0", *args], stdout=subprocess.PIPE, stderr=log, text=True
            )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                line = self.proc.stdout.readline()
                if match := re.search(r" at (http://\S+)/v1 ", line):
                    self.url = match.group(1)
                    return
        self.kill()
        raise AssertionError(f"the server did not start: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    tmp = tmp_path_factory.mktemp("lm_eval_server")
    args = ["--model", smollm2_path, "--dtype", "float32", "--num-kv-blocks", "256"]
    s = Server(tmp, *args, "--served-model-name", "smol", "--served-model-name", "smol-2")
    try:
        yield s
    finally:
        s.kill()


def test_local_completions_loglikelihood_and_generate_until(
    server, smollm2_path, tmp_path, monkeypatch
):
    # The start-up log names the HF directory clients load the tokenizer from.
    line = server.proc.stdout.readline().strip()
    hf_dir = line.rsplit(" ", 1)[-1]
    assert line.startswith("tinyserve: model directory") and hf_dir == smollm2_path
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for name, rows in (("choice", MULTIPLE_CHOICE), ("generate", GENERATE)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i, task in enumerate(TASKS.format(dir=tmp_path).split("---\n")):
        (tmp_path / f"task{i}.yaml").write_text(textwrap.dedent(task))

    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{server.url}/v1/completions",
            "model": "smol",
            "tokenizer": hf_dir,
            "tokenizer_backend": "huggingface",
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["tiny_choice", "tiny_generate"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=4,
        log_samples=True,
    )
    results = out["results"]
    print(json.dumps(results, indent=1))
    acc = results["tiny_choice"]["acc,none"]
    exact = results["tiny_generate"]["exact_match,none"]
    assert 0 <= acc <= 1 and 0 <= exact <= 1
    assert acc >= 0.75 and exact == 0.5  # even a 135M model knows these (greedy: exactly one)
    samples = out["samples"]["tiny_choice"]
    assert len(samples) == len(MULTIPLE_CHOICE)
    for sample in samples:  # one (loglikelihood, is_greedy) per choice
        for loglikelihood, _ in sample["filtered_resps"]:
            assert math.isfinite(loglikelihood) and loglikelihood < 0
    generated = [s["filtered_resps"][0] for s in out["samples"]["tiny_generate"]]
    assert len(generated) == len(GENERATE) and all("\n" not in g for g in generated)
    print("generated:", generated)
    assert "Paris" in generated[0]
    log = server.log()
    assert "Traceback" not in log, log[-2000:]
