"""Start-up compiles: every Triton kernel variant a step can take is compiled before the first
request, since a variant compiled on first use stalls every stream mid-run for 0.2-1.2 s. The
CUDA graphs compile what their captures run; these functions cover what eager steps run: the
attention and sampling kernels' variants for every engine, and for speculative ones, whose steps
are eager far more often (every prompt chunk of an MTP model, which has no prefill graphs;
chunks beside verify rows; rows short of k drafts, whose MTP drafting is eager), and for engines
without graphs (`enforce_eager`), one eager step of each kind and row-count class. The kernels
take step sizes as runtime arguments (`do_not_specialize`), so one count of a class compiles
what every count of it needs (`test_mtp_steps_after_start_up_compile_no_kernel` checks it).

Every function takes the ModelRunner (duck-typed: this module sits below runner.py) and writes
only the KV cache's scratch block (and a hybrid model's scratch state slot), which the pools
never hand out."""

from __future__ import annotations

import torch

from tinyserve.core.scheduler import ScheduledBatch
from tinyserve.core.sequence import Sequence
from tinyserve.kernels._common import num_sms
from tinyserve.kernels.decode_attention import MAX_TILE_ROWS, decode_attention
from tinyserve.kernels.gemv_config import CUBLAS_QKV_ROWS
from tinyserve.kernels.prefill_attention import prefill_attention, prefill_tiles
from tinyserve.kernels.sampling import argmax, sample_race
from tinyserve.kernels.spec_accept import accept_drafts
from tinyserve.kernels.spec_shift import spec_shift
from tinyserve.runner.graph_shapes import SHORT_SPLIT_BLOCK_N
from tinyserve.sample.sampler import SamplingRow
from tinyserve.sampling_params import SamplingParams

# Representatives of the row-count classes the kernels tell apart: one count in each power-of-
# two range (the gemv tiles are next_pow2(M) rows, and its method thresholds are powers of two
# but for CUBLAS_QKV_ROWS, within 33-64), and the powers of two from 16 (a full x tile, no rows
# masked: `gemv_config.x_tile`), up to 256 rows (beyond, matmuls are cuBLAS and the other
# kernels take any count alike).
ROW_CLASSES = (1, 2, 3, 5, 9, 16, 17, 32, 33, CUBLAS_QKV_ROWS + 1, 64, 65, 128, 129)
_GREEDY = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def compile_start_up(runner) -> None:
    """All of the below that applies to the runner's engine (CUDA only)."""
    compile_prefill_attention(runner)
    compile_decode_attention(runner)
    compile_sampling(runner)
    if runner.is_hybrid:  # the DeltaNet kernels an eager step runs: a prompt chunk's
        _eager_step(runner, [_sequence(runner, 2, 0)], [2])
    if runner.config.num_speculative_tokens:
        compile_speculative(runner)
    elif runner.config.enforce_eager:  # no graphs: every step is eager, its matmuls' too
        run_eager_steps(runner)


def compile_prefill_attention(runner) -> None:
    """Every prefill-kernel variant eager steps can take (each tile, one pass and key splits):
    the first long prompt chunked beside decode rows would compile one mid-step and stall every
    stream (a ~2 s inter-token gap). One token on the scratch block."""
    layer, heads, head_dim = _attention(runner)
    q = torch.zeros(1, heads, head_dim, dtype=runner.dtype, device=runner.device)
    table = torch.full((1, 1), runner.num_kv_blocks, dtype=torch.int32, device=runner.device)
    cu, lens = (torch.tensor(v, dtype=torch.int32, device=runner.device) for v in ([0, 1], [1]))
    for m, n, warps, stages in prefill_tiles(runner.dtype, runner.device, head_dim):
        for splits in (1, 2):
            prefill_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                table,
                cu,
                lens,
                1,
                layer.scale,
                num_splits=splits,
                block_m=m,
                block_n=n,
                num_warps=warps,
                num_stages=stages,
            )


def compile_decode_attention(runner) -> None:
    """Every decode-kernel variant an eager step can take, at one query a row and at the verify
    step's k + 1: one pass or key splits, the short split's key tile, and the early fetch of a
    grid of at most two waves or not (the split count itself is a runtime argument); then the
    merge's tile for up to 16, 32 and 64 splits. The graphs compile only their padded sizes'."""
    layer, heads, head_dim = _attention(runner)
    kv_heads, dev = layer.k_cache.shape[2], runner.device
    k = runner.config.num_speculative_tokens
    query_lens = (1, k + 1) if k and (k + 1) * heads // kv_heads <= MAX_TILE_ROWS else (1,)
    waves = 2 * num_sms(dev) // kv_heads + 1  # rows whose grid is more than two waves

    def run(batch: int, query_len: int, splits: int, block_n: int | None) -> None:
        q = torch.zeros(batch * query_len, heads, head_dim, dtype=runner.dtype, device=dev)
        table = torch.full((batch, 1), runner.num_kv_blocks, dtype=torch.int32, device=dev)
        lens = torch.full((batch,), query_len, dtype=torch.int32, device=dev)
        decode_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            table,
            lens,
            layer.scale,
            num_splits=splits,
            block_n=block_n,
            query_len=query_len,
        )

    for query_len in query_lens:
        for splits, block_n in ((1, None), (2, None), (2, SHORT_SPLIT_BLOCK_N)):
            for batch in (1, -(-waves // splits)):
                run(batch, query_len, splits, block_n)
        for splits in (32, 64):
            run(1, query_len, splits, None)


def compile_sampling(runner) -> None:
    """The race kernels' variants: the argmax, all rows sampled, and greedy rows among sampled
    ones. The graphs compile only the variants their captures run, so an eager step's first
    sampled rows would compile one mid-run (~0.2 s)."""
    vocab = runner.model.lm_head.weight.shape[0]
    x = torch.zeros(2, vocab, dtype=torch.float32, device=runner.device)
    keys = torch.zeros(2, dtype=torch.int64, device=runner.device)
    argmax(x)
    sample_race(x, keys)
    sample_race(x, keys, torch.tensor([True, False], device=runner.device))


def compile_speculative(runner) -> None:
    """The accept kernel (a forced count on the host and on the device), the overlapped loop's
    shift kernel (each part), then `run_eager_steps`."""
    k, dev = runner.config.num_speculative_tokens, runner.device
    ids = torch.zeros(k + 1, dtype=torch.long, device=dev)
    starts = torch.zeros(1, dtype=torch.long, device=dev)
    for force in (None, torch.full((1,), -1, dtype=torch.long, device=dev)):
        accept_drafts(ids.clone(), ids, starts, k + 1, force)
    one = torch.zeros(1, dtype=torch.long, device=dev)
    shift = (one,) * 6
    drafts = torch.zeros(1, k, dtype=torch.long, device=dev)
    ctx = torch.ones(1, dtype=torch.int32, device=dev)
    table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    for accepted in (None, one):
        prev = (accepted, ids, one, drafts)
        for fix_inputs, fix_drafts in ((True, True), (True, False), (False, True)):
            inputs = (one.clone(), one.clone(), one.clone(), ctx, table) if fix_inputs else None
            spec_shift(shift, prev, inputs, runner.block_size, one.clone() if fix_drafts else None)
    run_eager_steps(runner)


def run_eager_steps(runner) -> None:
    """One eager step of each kind and row-count class through `runner.launch`: a prompt chunk,
    decode rows without drafts (an MTP model drafts for them eagerly) and verify rows beside a
    prompt chunk (without speculation: decode rows beside it, a mixed step), on sequences of the
    scratch block."""
    cfg, k = runner.config, runner.config.num_speculative_tokens or 0
    max_len = runner.max_blocks_per_seq * runner.block_size
    if k + 3 > max_len:  # no room for a row's token, its drafts and the one after
        return
    for n in ROW_CLASSES:
        if n + k + 1 <= min(cfg.max_num_batched_tokens, max_len):
            _eager_step(runner, [_sequence(runner, n, 0)], [n])  # a prompt chunk
        if n <= cfg.max_num_seqs:  # rows of two tokens, the second one new
            _eager_step(runner, [_sequence(runner, 2, 0, 1) for _ in range(n)], [1] * n)
        if n < cfg.max_num_seqs and n * (k + 1) + 1 <= cfg.max_num_batched_tokens:
            verify = [_sequence(runner, 2, k, 1) for _ in range(n)]
            _eager_step(runner, verify + [_sequence(runner, 1, 0)], [k + 1] * n + [1])


def _attention(runner):
    layer, mc = runner.attn_layers[0], runner.model_config
    return layer, mc.num_attention_heads, mc.head_dim


def _sequence(runner, num_tokens: int, num_drafts: int, computed: int = 0) -> Sequence:
    """A greedy sequence of token 0 whose every block is the scratch block."""
    seq = Sequence(-1, "warm-up", 0, [0] * num_tokens, num_tokens, _GREEDY, 0, 1)
    seq.num_kv_computed = computed
    seq.draft_ids = [0] * num_drafts
    seq.kv_token_limit = num_tokens + num_drafts
    seq.block_table = [runner.num_kv_blocks] * -(-seq.kv_token_limit // runner.block_size)
    return seq


def _eager_step(runner, seqs: list[Sequence], num_new: list[int]) -> None:
    batch = ScheduledBatch(seqs, num_new)
    rows = [SamplingRow(_GREEDY, 0, (), ()) for seq in seqs for _ in range(len(seq.draft_ids) + 1)]
    runner.launch(batch, rows).result()
