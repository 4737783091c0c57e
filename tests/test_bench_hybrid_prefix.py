"""`bench.py hybrid-prefix` end to end on a tiny random Qwen3.5 checkpoint (with MTP weights) at
tiny sizes: a row per workload and cache setting, the JSON written, cache-on hit rates above 0
and at most their block-granular ideal; and that ideal (`ideal_hits`) on hand-made requests."""

from __future__ import annotations

import json
import os

import pytest
import torch
from qwen3_5_helpers import add_mtp_weights, make_checkpoint

from tinyserve.bench import cli, hybrid_prefix
from tinyserve.bench.hybrid_prefix import ideal_hits

pytest.importorskip("transformers")

TINY = dict(groups=2, group_size=3, system=48, question=8, out=12)
TINY |= dict(chats=2, turns=3, first=(20, 40), message=(4, 12), suffixes=4, suffix=10)
EPS = 1e-9


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """published_tied with MTP weights; positions for the prompts (its default is 128)."""
    path = tmp_path_factory.mktemp("hybrid_prefix")
    hf = make_checkpoint(path, "published_tied", 0)
    add_mtp_weights(path, hf.model, 1)
    with open(path / "config.json") as f:
        config = json.load(f)
    config["max_position_embeddings"] = 1024
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture
def one_thread():
    """A tiny model gains nothing from threads, and two OpenMP threads on a busy two-core
    machine spin: a 64 x 64 linear took 16 ms instead of 20 us, the test minutes."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


def test_rows_on_a_tiny_checkpoint(checkpoint, tmp_path, monkeypatch, one_thread, capsys):
    monkeypatch.setitem(hybrid_prefix.SIZES, True, TINY)
    # Decode saves at every block end (the engine's 4 would take none in 12 tokens).
    argv = ["hybrid-prefix", "--small", "--model", checkpoint, "--out", str(tmp_path)]
    argv += ["--max-num-seqs", "16", "--max-num-batched-tokens", "64"]
    cli.main(argv + ["--prefix-cache-decode-state-interval", "1"])
    (name,) = os.listdir(tmp_path)
    with open(tmp_path / name) as f:
        res = json.load(f)
    assert res["workload"] == "hybrid-prefix" and res["sizes"]["out"] == TINY["out"]
    rows = {(r["workload"], r["cache"]): r for r in res["rows"]}
    every = [(w, c) for w in ("shared", "multiturn", "suffix", "suffix-mtp") for c in ("on", "off")]
    assert sorted(rows) == sorted(every + [("shared", "on_no_decode_saves")])
    num = {"shared": 6, "multiturn": 6, "suffix": 4, "suffix-mtp": 4}
    for (workload, cache), row in rows.items():
        assert row["requests"] == num[workload]
        assert row["output_tokens"] == num[workload] * TINY["out"]
        assert row["ttft_median_s"] > 0 and row["ttft_p99_s"] >= row["ttft_median_s"]
        assert row["tok_per_s"] > 0
        assert 0 < row["hit_rate_theory"] < 1
        if cache == "off":
            assert row["hit_rate"] == 0 and row["checkpoint_saves"] == 0
        else:
            assert 0 < row["hit_rate"] <= row["hit_rate_theory"] + EPS
            assert row["checkpoint_saves"] > 0
        if cache == "on":
            assert row["ttft_speedup"] > 0 and row["throughput_ratio"] > 0
        assert ("decode_tok_per_s" in row) == (workload != "multiturn")
    # Prompts sharing a prefix, sent at once: the first one's branch checkpoints serve the
    # rest (`checkpoint_policy.shared_boundaries`), so these hit what a plain block cache would.
    for workload in ("shared", "suffix", "suffix-mtp"):
        row = rows[workload, "on"]
        assert abs(row["hit_rate"] - row["hit_rate_theory"]) < EPS, (workload, row)
    on, no_saves = rows["shared", "on"], rows["shared", "on_no_decode_saves"]
    assert on["checkpoint_saves"] > no_saves["checkpoint_saves"]
    assert on["decode_save_cost"] < 1
    # One block of the shared prompt fewer with MTP: a block's key holds the token after it.
    assert rows["suffix-mtp", "on"]["hit_rate_theory"] < rows["suffix", "on"]["hit_rate_theory"]
    assert "workload=shared  cache=on_no_decode_saves" in capsys.readouterr().out


def test_ideal_hits():
    """Block-granular, never the prompt's last token; a chat's next turn reuses the previous
    prompt + answer but its last token (no KV); with MTP a block also needs the next token."""
    bs, ids = 4, list(range(10))
    a, b = ids[:8] + [50, 51, 52], ids[:8] + [60, 61]  # an 8-token shared prompt: 2 blocks
    assert ideal_hits([(a, [1]), (b, [2])], bs, False) == [0, 8]
    assert ideal_hits([(ids[:8], [1]), (ids[:8] + [9], [])], bs, False) == [0, 8]
    assert ideal_hits([(ids[:9], []), (ids[:9], [])], bs, False) == [0, 8]
    assert ideal_hits([(ids[:8], []), (ids[:8], [])], bs, False) == [0, 4]  # the last token
    # Turn 2 = turn 1's 6 prompt + 5 answer tokens + a message: floor((6 + 5 - 1) / 4) * 4.
    p1, out1 = [7] * 6, [8] * 5
    assert ideal_hits([(p1, out1), (p1 + out1 + [9, 9, 9], [])], bs, False) == [0, 8]
    assert ideal_hits([(p1, out1 + [3]), (p1 + out1 + [3, 9], [])], bs, False) == [0, 8]
    # MTP: the second block's key holds the token after it (50 vs 60): one block.
    assert ideal_hits([(a, [1]), (b, [2])], bs, True) == [0, 4]
    assert ideal_hits([(p1, out1), (p1 + out1 + [9, 9, 9], [])], bs, True) == [0, 8]


def test_mtp_row_needs_mtp_layers(checkpoint, tmp_path):
    """Refused before any engine starts, not after the other rows ran."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    del config["mtp_num_hidden_layers"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(SystemExit, match="suffix-mtp needs MTP layers"):
        cli.main(["hybrid-prefix", "--small", "--model", str(tmp_path), "--out", str(tmp_path)])
