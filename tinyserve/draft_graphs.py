"""The verify step's second graph (MTP models): after a verify replay, the accepted counts and
the next drafts, captured per padded batch size, so a verify step runs no eager kernel between
its two graphs."""

from __future__ import annotations

import torch

from tinyserve.graph_shapes import round_up
from tinyserve.graphs import DecodeGraphs
from tinyserve.kernels.spec_accept import accept


class DraftGraphs:
    """Per padded size of the verify graphs: the accepted counts (from the replay's tokens in
    `last_sampled`, the staged drafts and the forced count) and `draft_tokens` (the MTP
    drafting, `MtpDrafter.draft_tokens`) over the replay's hidden states. Padded rows own no KV
    slots (limit 0, no drafts): their chained drafts write the scratch slot. With the verify
    set's capture=False the same runs eagerly (the CPU tests)."""

    def __init__(self, verify: DecodeGraphs, draft_tokens) -> None:
        self.verify = v = verify
        n, q, dev = v.sizes[-1], v.query_len, v.buffer.device
        self.draft_next = torch.full((n * q,), -1, dtype=torch.long, device=dev)
        self.limits = torch.zeros(n, dtype=torch.long, device=dev)
        self.force = torch.full((1,), -1, dtype=torch.long, device=dev)  # -1: not forced
        # The accepted counts live outside the graph pool: the next step's sampling reads them
        # (seeded counters) after the next verify replay, whose scratch the pool may reuse.
        self.accepted = torch.zeros(n, dtype=torch.long, device=dev)
        self.staged_force: int | None = None
        self.seg_starts = torch.arange(0, n * q, q, device=dev)
        self.graphs: dict[int, tuple] = {}  # bs -> (graph, outs), or (None, run) eagerly
        pool = v.pool
        for bs in reversed(v.sizes):
            key = v.keys(bs)[0]  # any split count's: they share inputs and `hidden`

            def run(bs=bs, key=key) -> tuple[torch.Tensor, torch.Tensor]:
                # A verify step samples every row: its tokens are the MTP layer's next ids.
                sampled, starts = v.last_sampled[: bs * q], self.seg_starts[:bs]
                accepted = accept(sampled, self.draft_next[: bs * q], starts, q, self.force,
                                  out=self.accepted[:bs])  # fmt: skip
                drafts = draft_tokens(v.metadata[key], v.fields(bs)[2], v.outputs[key][0],
                                      sampled, starts + accepted, v.block_tables[:bs],
                                      self.limits[:bs], None)  # fmt: skip
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

    def stage(self, draft_next: torch.Tensor, limits: torch.Tensor,
              force: int | None) -> torch.Tensor:  # fmt: skip
        """Before a verify replay: copy the drafts it verifies (R,) and the KV limits (B,) in,
        and the forced count where it changed (benchmarks); returns the drafts' static view,
        which the shift of the step in flight then edits in place."""
        b, q, r = limits.shape[0], self.verify.query_len, draft_next.shape[0]
        bs = round_up(self.verify.sizes, b)
        self.draft_next[:r].copy_(draft_next)
        self.limits[:b].copy_(limits)
        if b < bs:  # padded rows: no drafts, no KV
            self.draft_next[r : bs * q].fill_(-1)
            self.limits[b:bs].zero_()
        if force != self.staged_force:
            self.force.fill_(-1 if force is None else force)
            self.staged_force = force
        return self.draft_next[:r]

    def draft(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After the verify replay of b rows: replay the accept-and-draft graph of its size
        (`last_sampled` must hold the step's tokens); (B,) accepted counts, valid until the
        next drafting replay, and (B, k) drafts, valid only until the next verify replay (they
        sit in the graph pool, which that replay's scratch may reuse)."""
        graph, outs = self.graphs[round_up(self.verify.sizes, b)]
        if graph is None:  # capture=False: `outs` is the run itself
            outs = outs()
        else:
            graph.replay()
        return outs[0][:b], outs[1][:b]
