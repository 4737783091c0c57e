"""Draft token maps: the MTP head drafts only the map's ids and stays lossless, bad maps
are refused, and `tinyserve token-map` builds one from a corpus."""

from __future__ import annotations

import json

import pytest
import torch
from spec_helpers import VOCAB, make_llm, prompts, reference_drafts, run

from tinyserve import LLM, SamplingParams
from tinyserve.config import InvalidConfig


def write_map(tmp_path, ids, name: str = "map.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(ids))
    return str(path)


def test_token_map_drafts_only_its_ids_and_stays_lossless(mimo_dir, reference, tmp_path):
    """With a token map the MTP head drafts the argmax over the map's ids (a third of the
    vocabulary here, listed in reverse, so a wrong index-to-id mapping shows); verification
    is unchanged, so outputs equal speculation off."""
    hot = list(range(VOCAB - 1, -1, -3))
    token_map = write_map(tmp_path, hot)
    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=2,
        speculative_token_map=token_map,
    )
    assert run(llm, prompts()) == reference
    assert llm.engine.spec.stats.num_draft_tokens > 0

    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_token_map=token_map,
        async_scheduling=False,
    )
    engine = llm.engine
    for i, p in enumerate(prompts(3)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    drafted = []
    while engine.has_unfinished():
        engine.step()
        for s in engine.scheduler.running:
            if s.draft_ids:
                want = reference_drafts(engine.runner.model, s.token_ids, 3, allowed=hot)
                assert s.draft_ids == want[: len(s.draft_ids)]
                drafted += s.draft_ids
    assert len(drafted) > 10 and set(drafted) <= set(hot)


def test_token_map_with_chunks_and_preemption_is_lossless(mimo_dir, reference, tmp_path):
    """A map changes only which drafts the head proposes: chunked prefill (budget 16), KV
    pressure (preemption) and the prefix cache keep speculation-off's tokens."""
    llm = make_llm(
        mimo_dir,
        speculative_method="mtp",
        num_speculative_tokens=3,
        speculative_token_map=write_map(tmp_path, list(range(0, VOCAB, 2))),
        max_num_batched_tokens=16,
        num_kv_blocks=24,
    )
    assert run(llm, prompts()) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_token_map_errors(mimo_dir, tmp_path):
    from tinyserve.spec.token_map import load_token_map

    with pytest.raises(InvalidConfig, match="speculative_token_map: applies to .*mtp"):
        LLM(
            None,
            speculative_method="ngram",
            num_speculative_tokens=2,
            speculative_token_map=write_map(tmp_path, [1]),
        )
    bad = {
        "missing.json": None,
        "text.json": "not json",
        "dict.json": {"ids": [1]},
        "empty.json": [],
        "range.json": [1, VOCAB],
        "negative.json": [-1],
        "bool.json": [True],
        "float.json": [1.5],
        "twice.json": [3, 4, 3],
    }
    for name, content in bad.items():
        if content is not None:
            (tmp_path / name).write_text(
                content if isinstance(content, str) else json.dumps(content)
            )
        with pytest.raises(InvalidConfig, match="speculative_token_map") as e:
            load_token_map(str(tmp_path / name), VOCAB)
        assert name in str(e.value)
    torch.save(torch.tensor([5, 2]), tmp_path / "sglang.pt")  # never unpickled: a pickle runs code
    with pytest.raises(InvalidConfig, match="pickled tensor is not loaded.*JSON list"):
        load_token_map(str(tmp_path / "sglang.pt"), VOCAB)
    assert load_token_map(write_map(tmp_path, [5, 2], "ok.json"), VOCAB).tolist() == [5, 2]
    with pytest.raises(InvalidConfig, match="not a token id"):  # checked before any weights load
        make_llm(
            mimo_dir,
            speculative_method="mtp",
            num_speculative_tokens=1,
            speculative_token_map=write_map(tmp_path, [VOCAB + 5]),
        )


def word_tokenizer_dir(tmp_path):
    """A word-level tokenizer: <eos> 0 (special), then a..e."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<eos>", "<unk>", "a", "b", "c", "d", "e"])}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def test_build_token_map_takes_specials_the_most_frequent_then_the_lowest_ids(tmp_path):
    from tinyserve.model.tokenizer import Tokenizer
    from tinyserve.spec.token_map import build_token_map

    tok = Tokenizer.from_pretrained(word_tokenizer_dir(tmp_path))
    lines = ["c c c b\n", "d b e\n", "c\n"]  # c 4, b 2, d 1, e 1 (tie: the lower id first)
    assert build_token_map(tok, lines, 4) == [0, 4, 3, 5]
    # the text used 5 ids: the lowest unused ones fill up, to the vocabulary's 7 at most
    assert build_token_map(tok, lines, 99, batch=2) == [0, 4, 3, 5, 6, 1, 2]
    assert build_token_map(tok, lines, 1) == [0]
    assert build_token_map(tok, [], 3) == [0, 1, 2]  # no text: the lowest ids


def test_token_map_command_writes_a_map_the_engine_reads(tmp_path):
    from click.testing import CliRunner

    from tinyserve.cli import main
    from tinyserve.spec.token_map import load_token_map

    model = word_tokenizer_dir(tmp_path)
    (tmp_path / "corpus.txt").write_text("a b a\nb a e\n")
    out = tmp_path / "map.json"
    args = [
        "token-map",
        "--model",
        str(model),
        "--size",
        "3",
        "--out",
        str(out),
        str(tmp_path / "corpus.txt"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert load_token_map(str(out), 7).tolist() == [0, 2, 3]
    bad = CliRunner().invoke(main, ["token-map", "--model", str(tmp_path / "none"), str(out)])
    assert bad.exit_code != 0 and "cannot load the tokenizer" in bad.output
