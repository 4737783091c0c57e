"""The verify step's second graph (MTP models): after a verify replay, the accepted counts and
the next drafts, captured per padded batch size, so a verify step runs no eager kernel between
its two graphs."""

from __future__ import annotations

import numpy as np
import torch

from tinyserve.kernels.spec_accept import accept
from tinyserve.runner.graph_shapes import round_up
from tinyserve.runner.graphs import DecodeGraphs


class DraftGraphs:
    """Per padded size of the verify graphs: the accepted counts (from the replay's tokens in
    `last_sampled`, the staged drafts and the forced count) and `draft_tokens` (the MTP
    drafting, `MtpDrafter.draft_tokens`) over the replay's hidden states. Padded rows own no KV
    slots (limit 0, no drafts): their chained drafts write the scratch slot. With the verify
    set's capture=False the same runs eagerly (the CPU tests).

    The drafts a step verifies and its KV limits come with the verify replay's inputs, in its
    one host-to-device copy (`extras`, the verify set's `extra` arrays); the step's tokens,
    accepted counts and drafts leave in one device-to-host copy (`results`, `split`): five
    fewer copies a step."""

    def __init__(self, verify: DecodeGraphs, draft_tokens, decode_last: torch.Tensor) -> None:
        self.verify = v = verify
        n, q, dev = v.sizes[-1], v.query_len, v.buffer.device
        self.force = torch.full((1,), -1, dtype=torch.long, device=dev)  # -1: not forced
        self.staged_force: int | None = None
        self.seg_starts = torch.arange(0, n * q, q, device=dev)
        # Per size bs: the step's tokens (bs q), accepted counts (bs), then drafts (bs k),
        # outside the graph pool: the next step's sampling reads the counts after the next
        # verify replay, whose scratch the pool may reuse. Valid until the next drafting replay.
        self.results = torch.zeros(2 * n * q, dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple] = {}  # bs -> (graph, outs), or (None, run) eagerly
        pool = v.pool
        for bs in reversed(v.sizes):
            key = v.keys(bs)[0]  # any split count's: they share inputs and `hidden`

            def run(bs=bs, key=key) -> tuple[torch.Tensor, torch.Tensor]:
                # A verify step samples every row: its tokens are the MTP layer's next ids.
                sampled, starts = v.last_sampled[: bs * q], self.seg_starts[:bs]
                draft_next, limits = v.extra_views(bs, [bs * q, bs])
                tokens, accepted, drafts = self._parts(self.results[: 2 * bs * q], bs)
                chosen = torch.empty_like(starts)  # each row's last verified token
                # The tokens also go to where a decode graph step gathers its inputs.
                accept(
                    sampled,
                    draft_next,
                    starts,
                    q,
                    self.force,
                    out=accepted,
                    last=chosen,
                    copies=(tokens, decode_last),
                )
                draft_tokens(
                    v.metadata[key],
                    v.fields(bs)[2],
                    v.outputs[key][0],
                    sampled,
                    chosen,
                    v.block_tables[:bs],
                    limits,
                    None,
                    out=drafts,
                )
                return accepted, drafts

            if not v.capture:  # `draft` runs it after the eager replay
                self.graphs[bs] = (None, run)
                continue
            run()  # warm-up outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outs = run()
            pool = graph.pool()
            self.graphs[bs] = (graph, outs)
        v.pool = pool

    def extras(
        self, draft_next: list[int], limits: list[int], force: int | None
    ) -> list[np.ndarray]:
        """The verify replay's `extra` arrays for the drafts it verifies (R,) and the KV
        limits (B,), padded to the size (padded rows: no drafts, no KV); sets the forced count
        where it changed (benchmarks)."""
        b, q = len(limits), self.verify.query_len
        bs = round_up(self.verify.sizes, b)
        padded_drafts = np.full(bs * q, -1, dtype=np.int64)
        padded_drafts[: len(draft_next)] = draft_next
        padded_limits = np.zeros(bs, dtype=np.int64)
        padded_limits[:b] = limits
        if force != self.staged_force:
            self.force.fill_(-1 if force is None else force)
            self.staged_force = force
        return [padded_drafts, padded_limits]

    def draft(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After the verify replay of b rows: replay the accept-and-draft graph of its size
        (`last_sampled` must hold the step's tokens); (B,) accepted counts and (B, k) drafts,
        and the size's whole `results` (for one copy to the host, `split`)."""
        bs = round_up(self.verify.sizes, b)
        graph, outs = self.graphs[bs]
        if graph is None:  # capture=False: `outs` is the run itself
            outs = outs()
        else:
            graph.replay()
        return outs[0][:b], outs[1][:b], self.results[: 2 * bs * self.verify.query_len]

    def split(self, results: torch.Tensor, b: int) -> list[torch.Tensor]:
        """A copy of `draft`'s results -> the b rows' tokens (b q), accepted counts (b) and
        drafts (b, k)."""
        q = self.verify.query_len
        tokens, accepted, drafts = self._parts(results, len(results) // (2 * q))
        return [tokens[: b * q], accepted[:b], drafts[:b]]

    def _parts(self, results: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
        """Size bs's results (2 bs q) -> its tokens (bs q), accepted counts (bs), drafts (bs, k)."""
        q = self.verify.query_len
        return results[: bs * q], results[bs * q : bs * q + bs], results[bs * q + bs :].view(bs, -1)
