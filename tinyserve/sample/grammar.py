"""Structured outputs through xgrammar: a spec (JSON schema, regex, choice, EBNF, any JSON object)
compiles into a token-level grammar; each constrained sequence walks it with its own matcher.

`GrammarCompiler.compile` is thread-safe, releases the GIL while it works and caches by spec: the
server runs it in an executor, the offline `LLM` inline. Each step the engine fills the rows of
constrained sequences on the host (`StepBitmask.fill`, after the last step's tokens advanced the
matchers) into a pinned int32 buffer; `sample` copies it without a sync and masks those logits
rows to -inf before everything else (`apply_token_bitmask`). xgrammar is imported on first use:
its import takes seconds (it imports transformers, which tinyserve itself never uses).
A reasoning budget's forced end ids (sample/reasoning.py) ride the same mask as one-bit rows.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tinyserve.sample.transfer import to_device
from tinyserve.sampling_params import InvalidParameter, StructuredOutputsParams

if TYPE_CHECKING:
    from tinyserve.core.sequence import Sequence as Seq
    from tinyserve.model.tokenizer import Tokenizer

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept (LRU); a large-vocab JSON schema is ~MBs
# xgrammar's errors open with a timestamp and the C++ file and line: not for clients.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def vocab_type(tokenizer_json: dict) -> tuple[int, bool]:
    """(xgrammar VocabType value, add_prefix_space) from tokenizer.json, read as xgrammar's own
    detection reads a transformers tokenizer (`TokenizerInfo.from_huggingface`; the tests
    compare): a ByteLevel decoder means GPT-2 style byte-to-unicode tokens (BYTE_LEVEL: SmolLM2,
    Llama 3, Qwen); a ByteFallback decoder, sentencepiece "▁" words with <0xNN> byte tokens
    (BYTE_FALLBACK: Llama 2, Mistral); else RAW. The tokenizer prepends a space when its
    Metaspace pre-tokenizer or a Prepend normalizer says so."""
    decoder = tokenizer_json.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders") or [decoder] if d}
    kind = 2 if "ByteLevel" in kinds else 1 if "ByteFallback" in kinds else 0
    pre, norm = tokenizer_json.get("pre_tokenizer") or {}, tokenizer_json.get("normalizer") or {}
    prepend = pre.get("type") == "Metaspace" and pre.get("prepend_scheme") in ("first", "always")
    norms = norm.get("normalizers") or [norm]
    prepend |= any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in norms if n)
    return kind, prepend


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]):
    """`xgr.TokenizerInfo` from our tokenizer (never transformers): the encoded vocabulary by
    id, padded with "" to the model's `vocab_size` (the logits width). Special added tokens are
    "" too: xgrammar never allows those, so `<|im_end|>` cannot spell text inside a string; the
    stop ids (EOS) are allowed exactly where the grammar is complete."""
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    for i in tokenizer.all_special_ids:
        if i < vocab_size:
            encoded[i] = ""
    kind, add_prefix_space = vocab_type(json.loads(backend.to_str()))
    return xgr.TokenizerInfo(
        encoded,
        xgr.VocabType(kind),
        vocab_size=vocab_size,
        stop_token_ids=list(stop_ids) or None,
        add_prefix_space=add_prefix_space,
    )


@dataclass(frozen=True, slots=True, eq=False)
class Grammar:
    """A compiled spec: what `LLMEngine.compile_grammar` returns and `add_request` takes."""

    key: tuple[str, str]  # StructuredOutputsParams.key
    compiled: Any  # xgr.CompiledGrammar

    def matcher(self) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compiled))


class GrammarCompiler:
    """One per engine: xgrammar's compiler for this tokenizer, built on first use, and an LRU of
    compiled grammars by spec. Thread-safe (the server compiles in executor threads while the
    engine's worker thread steps)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, list(stop_ids)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0

    def load(self) -> None:
        """Import xgrammar and index the vocabulary now (~3 s, mostly xgrammar's import): a
        server may call this in a thread at start-up, else the first compile pays it."""
        self._xgr_compiler()

    def _xgr_compiler(self):
        with self._lock:  # the first two requests may race to build it
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                # Our LRU is the cache: its hits are countable and its size bounded.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The spec's grammar, from the cache or compiled now (~1-100 ms, without the GIL).
        Raises InvalidParameter for a schema, regex or grammar that xgrammar rejects."""
        key = spec.key
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return hit
        compiler = self._xgr_compiler()
        kind, text = key
        try:
            if kind in ("json", "json-compact"):
                compiled = compiler.compile_json_schema(text, any_whitespace=kind == "json")
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:  # choice, grammar: EBNF with a `root` rule
                compiled = compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses
            message = _ERROR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e) else "")
            raise InvalidParameter(
                "structured_outputs", f"invalid structured_outputs.{spec.kind}: {message[:300]}"
            ) from None
        grammar = Grammar(key, compiled)
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = grammar
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar


class GrammarState:
    """One sequence's position in its grammar (n > 1: one each). Touched by the engine's step
    thread only.

    The overlapped loop advances a matcher before the step's tokens are post-processed
    (`advance_early`, to fill the next step's mask while its forward runs); `finishes_on` then
    takes that token's recorded answer instead of advancing twice."""

    __slots__ = ("matcher", "done", "_early")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.done = False  # the last token ended the grammar: no row to mask after it
        self._early: deque[tuple[int, bool]] = deque()  # (token, finishes) advanced early

    def advance_early(self, token: int) -> None:
        """Advance over a sampled token before `finishes_on` sees it."""
        self._early.append((token, self._advance(token)))

    def finishes_on(self, token: int) -> bool:
        """Advance over a verified token; True when the sequence must stop there: the grammar
        accepted a stop token (it is complete), or rejected the token, which only happens
        when every allowed token was masked by something else (min_tokens on EOS)."""
        if self._early:
            early, finishes = self._early.popleft()
            assert early == token, "advanced early over another token"
            return finishes
        return self._advance(token)

    def _advance(self, token: int) -> bool:
        m = self.matcher
        self.done = not m.accept_token(token) or m.is_terminated()
        return self.done

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after the verified tokens (a
        rejected draft could never be accepted: its row's mask excludes it)."""
        m = self.matcher
        num = 0
        while num < len(drafts) and not m.is_terminated() and m.accept_token(drafts[num]):
            num += 1
        if num:
            m.rollback(num)
        return drafts[:num]

    def fill(self, bitmask: Tensor, row: int, drafts: list[int]) -> bool:
        """Rows row..row+len(drafts) of `bitmask`: the next token's mask, then each draft's next
        as if the drafts before it were accepted; rolls the drafts back. Rows past a draft the
        grammar rejects keep the last mask (their tokens are never accepted). Returns whether
        any row masks something."""
        m = self.matcher
        masks = m.fill_next_token_bitmask(bitmask, row)
        num = 0
        for j, d in enumerate(drafts, 1):
            if num == j - 1 and not m.is_terminated() and m.accept_token(d):
                num += 1
                masks |= m.fill_next_token_bitmask(bitmask, row + j)
            else:
                bitmask[row + j] = bitmask[row + j - 1]
        if num:
            m.rollback(num)
        return masks


@dataclass(slots=True)
class TokenBitmask:
    """A step's grammar masks for the sampler: the logits rows they cover, their bits."""

    rows: list[int]  # ascending logits rows of constrained sequences (and their drafts)
    bitmask: Tensor  # (len(rows), ceil(V / 32)) int32 on the host, pinned with CUDA; bit 1: allowed

    def to_device(self, device: torch.device) -> DeviceBitmask:
        # Both copies are from pinned memory: no sync (the engine runs these steps one at a
        # time, so `StepBitmask` never refills a buffer whose copy is still in flight).
        bitmask = self.bitmask.to(device, non_blocking=True)
        return DeviceBitmask(bitmask, to_device(self.rows, device), self.rows)


@dataclass(slots=True)
class DeviceBitmask:
    bitmask: Tensor  # (R, W) int32
    rows_dev: Tensor  # (R,) int64
    rows: list[int]


def apply_token_bitmask(logits: Tensor, m: DeviceBitmask) -> Tensor:
    """Disallowed tokens of the masked rows -> -inf, in place on `logits` (B, V) float32, by
    xgrammar's kernel (C++ on the CPU, Triton on CUDA). Rows without a grammar are untouched."""
    import xgrammar as xgr

    B, V = logits.shape
    bitmask, indices = m.bitmask, None
    if len(m.rows) != B:  # a mixed batch: spread the rows to their logits rows, all-ones elsewhere
        bitmask = torch.full((B, bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
        bitmask.index_copy_(0, m.rows_dev, m.bitmask)
        indices = m.rows if logits.device.type == "cpu" else m.rows_dev
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V, indices=indices)
    return logits


class StepBitmask:
    """The host buffers a step's masks are filled into: two, alternating, grown on demand
    (pinned memory is slow to allocate), so a step never overwrites the buffer of a copy that
    may still be in flight. Rows without drafts (the common case) are filled by xgrammar's
    batch matcher on its own threads, without the GIL: one row costs ~0.1 ms at a 150k-token
    vocabulary, so a 64-row step filled serially took longer than its forward."""

    def __init__(self, vocab_size: int, pin: bool) -> None:
        self.width = -(-vocab_size // 32)
        self.pin = pin
        self._buffers: list[Tensor] = [torch.empty(0, self.width, dtype=torch.int32)] * 2
        self._turn = 0
        self._batch = None  # xgr.BatchGrammarMatcher, built on first use

    def fill(
        self, seqs: Sequence[Seq], state_of: Callable[[Seq], GrammarState | int | None]
    ) -> TokenBitmask | None:
        """The masks of this step's sampling rows (`seqs` in batch order, one row per sequence
        plus one per draft), or None when no row is constrained.
        `state_of` (asked of sequences with structured outputs or reasoning): a sequence's
        grammar, or the one token it must emit (a forced row, which carries no drafts), or
        None (unconstrained this step)."""
        items, row = [], 0
        for seq in seqs:
            p = seq.params
            if p.structured_outputs is not None or p.reasoning is not None:
                if (state := state_of(seq)) is not None:
                    items.append((row, state, seq.draft_ids))
            row += 1 + len(seq.draft_ids)
        if not items:
            return None
        num = sum(1 + len(drafts) for _, _, drafts in items)
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if len(buf) < num:
            size = 1 << (num - 1).bit_length()
            buf = torch.empty(size, self.width, dtype=torch.int32, pin_memory=self.pin)
            self._buffers[self._turn] = buf
        rows, at, masks = [], 0, False
        batch, batch_rows = [], []  # rows without drafts: filled together below
        for first, state, drafts in items:
            if isinstance(state, int):  # one bit: that token, exactly
                assert not drafts, "a forced row carries drafts"
                buf[at] = 0
                word, bit = divmod(state, 32)
                buf[at, word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32
                masks = True
            elif drafts:
                masks |= state.fill(buf, at, drafts)
            else:
                batch.append(state.matcher)
                batch_rows.append(at)
            rows.extend(range(first, first + 1 + len(drafts)))
            at += 1 + len(drafts)
        if batch:
            self._batch_fill(batch, buf, batch_rows)
            # A grammar row restricts something in practice: no per-step scan of its bits.
            masks = True
        return TokenBitmask(rows, buf[:num]) if masks else None

    def _batch_fill(self, matchers: list, buf: Tensor, rows: list[int]) -> None:
        if len(matchers) == 1:  # no threads to wake for one row
            matchers[0].fill_next_token_bitmask(buf, rows[0])
            return
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._batch.batch_fill_next_token_bitmask(matchers, buf, rows)
