"""The hybrid prefix cache's policy (core/state_pool.py, core/scheduler.py): the DEBUG line per
admitted match (logger `tinyserve.prefix`: matched, where and why it was clamped, recomputed, the
checkpoint restored) and the branch-point counters, on a tiny random Qwen3.5 (fp32, CPU, greedy
tokens transformers'); checkpoint eviction in a CPU simulation of a shared system prompt beside
one-off prompts under a small state budget.
"""

from __future__ import annotations

import logging

import pytest
import test_qwen3_5_prefix as base
from qwen3_5_helpers import hf_greedy
from test_qwen3_5_prefix import BASE_KW, MAX_NEW, serve

from tinyserve import LLM

pytest.importorskip("transformers")
model = base.model  # the fixture: a tiny checkpoint, a system prompt and three questions


def match_lines(caplog) -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.name == "tinyserve.prefix"]
    caplog.clear()
    return lines


def test_match_log_and_branch_counters(model, caplog):
    """16-token chunks: request 1 saves at 16 and 32 (no match); request 2 matches the 7
    system-prompt blocks, is clamped to 16 (no save ended at 28) and recomputes 12 tokens up to
    the branch point, saving it; request 3 resumes there (a branch hit)."""
    path, hf, system, questions = model
    llm = LLM(path, **BASE_KW, max_num_batched_tokens=16)
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    got, lines = [], []
    for q in questions:
        got.append(serve(llm, system + q)[0])
        lines += match_lines(caplog)
    assert got == [hf_greedy(hf, system + q, MAX_NEW)[len(system + q) :] for q in questions]
    assert len(lines) == 3
    assert lines[0].endswith(": matched 0 of 39 tokens")
    assert lines[1].endswith(
        ": matched 28 of 39 tokens; clamped to 16 (no state after 28: no save ended there); "
        "recomputing 12 matched tokens; restored checkpoint 0"
    ), lines[1]
    assert ": matched 28 of 39 tokens; restored checkpoint" in lines[2]
    assert "clamped" not in lines[2]
    states = llm.engine.scheduler.state_pool
    assert (states.num_checkpoint_branch_saves, states.num_checkpoint_branch_hits) == (1, 1)
    assert states.num_checkpoint_hits == 2


def test_match_log_says_evicted(model, caplog):
    """A state budget of 1: request 1's save at 32 evicts its save at 16, a one-off prompt's
    save evicts that; a prompt sharing request 1's first 33 tokens is clamped to 0, and the log
    says the state after 32 was evicted."""
    path, hf, system, questions = model
    llm = LLM(path, **BASE_KW, max_num_batched_tokens=16, prefix_cache_state_budget=1)
    first = system + questions[0]
    serve(llm, first)
    serve(llm, questions[1] + questions[2])  # 18 tokens: saves at 16
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    prompt = first[:33] + questions[1]
    got, cached = serve(llm, prompt)
    assert got == hf_greedy(hf, prompt, MAX_NEW)[len(prompt) :] and cached == 0
    (line,) = match_lines(caplog)
    assert line.endswith(
        ": matched 32 of 42 tokens; clamped to 0 (no state after 32: evicted); "
        "recomputing 32 matched tokens"
    ), line


def test_match_log_without_checkpoint_slots(model, caplog):
    path, _, system, questions = model
    llm = LLM(path, **BASE_KW, prefix_cache_state_budget=0)
    serve(llm, system + questions[0])
    caplog.set_level(logging.DEBUG, logger="tinyserve.prefix")
    serve(llm, system + questions[1])
    (line,) = match_lines(caplog)
    assert "clamped to 0 (no state after 28: no checkpoint slots (state budget 0))" in line
