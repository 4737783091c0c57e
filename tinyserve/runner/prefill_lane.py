"""The prefill lane: a long prompt's chunks run beside the decode steps, not inside them.

Chunked into the steps (decode rows + one chunk), a 32k-token prompt makes every stream's
inter-token gap as long as its chunk's forward: 6-14x the gap without it. Here its chunks run
on a second CUDA stream instead, one captured graph of `chunk` tokens each, on a green context
that leaves `reserve_sms` SMs to the decode steps. Stream priorities alone do not do it: the
chunk's kernels fill every SM and each of a decode step's ~300 kernels waits for blocks to
retire (decode steps no faster than with one stream).

Chunks run in order, at most `depth` in flight. The scheduler owns the policy (which
sequence, when); this class owns the tensors: static inputs, the graph, the stream, events.
Before its inputs are copied, a chunk waits for the work already queued on the main stream:
a block the pool hands to the lane may have been freed by a sequence whose step is still
running (preemption), and the lane must not write it before that step is done.

On the CPU, or without a lane stream, a chunk runs eagerly at once (the tests drive the
scheduler and the engine through it)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections import deque

import torch

from tinyserve.model.layers.attention import AttentionMetadata, forward_context


@functools.cache
def lane_stream(reserve_sms: int, device_index: int) -> torch.cuda.Stream | None:
    """A stream whose kernels run on all but `reserve_sms` SMs, or None where the device
    cannot partition them (no green contexts in this torch or driver). One per process and
    count: its green context lives to the end of the process, because destroying it first
    makes every later use of its stream and events fail, in destructors too (a crash)."""
    try:
        from torch.cuda.green_contexts import GreenContext

        total = torch.cuda.get_device_properties(device_index).multi_processor_count
        ctx = GreenContext.create(num_sms=total - reserve_sms, device_id=device_index)
        stream = ctx.Stream()
    except (ImportError, AttributeError, RuntimeError):
        return None
    # One reference that is never dropped: a module-level list is cleared at interpreter exit,
    # possibly before an engine left in a global (or a traceback) frees tensors used on the
    # stream, whose destructors then record events in the destroyed context (a crash at exit).
    # The driver frees the context with the process.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(ctx))
    return stream


class PrefillLane:
    def __init__(
        self,
        model,
        chunk: int,
        max_blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        stream: torch.cuda.Stream | None,
        depth: int = 2,
        reserve_sms: int = 0,
    ) -> None:
        """`stream`: `lane_stream`'s, or None to run chunks eagerly; `reserve_sms`: the SMs
        its green context leaves to the steps (reported by bench.py)."""
        dev = next(model.parameters()).device
        self.model, self.chunk, self.block_size, self.depth = model, chunk, block_size, depth
        self.scratch_block = scratch_block
        self.stream, self.reserve_sms = stream, reserve_sms
        # Static inputs: the chunk's ids, then its first position, then the block table.
        self.inputs = torch.zeros(chunk + 1 + max_blocks_per_seq, dtype=torch.long, device=dev)
        # One pinned staging buffer per chunk in flight: the host fills the next one while
        # the copy out of the last may not have run yet.
        pin = dev.type == "cuda"
        self.staging = [
            torch.zeros_like(self.inputs, device="cpu", pin_memory=pin) for _ in range(depth)
        ]
        self.offsets = torch.arange(chunk, device=dev)
        self.cu = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        self.in_flight: deque[torch.cuda.Event | None] = deque()
        self.num_launched = 0
        self.graph = None
        self.inputs[chunk + 1 :] = scratch_block  # the warm-up and the capture write scratch KV
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run()  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize(dev)
            # Captured on the lane's own stream: a graph's kernels keep the context they were
            # captured in, so one captured elsewhere would run on every SM (decode steps as
            # slow as with no lane). A private memory pool: it runs beside others.
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self._run()

    def _run(self) -> None:
        """The chunk's forward: KV only (a lane chunk is never a prompt's last, so nothing is
        sampled). Positions and slots derive from the first position and the table."""
        c, bs = self.chunk, self.block_size
        ids, start, table = self.inputs.split([c, 1, self.inputs.shape[0] - c - 1])
        positions = start + self.offsets
        slots = table[positions // bs] * bs + positions % bs
        md = AttentionMetadata(
            slot_mapping=slots,
            block_tables=table.view(1, -1).to(torch.int32),
            cu_seqlens_q=self.cu,
            context_lens=(start + c).to(torch.int32),
            query_lens_cpu=[c],
            context_lens_cpu=[] if ids.is_cuda else [int(start) + c],
            max_context_len=0,  # unknown to a graph: the kernel reads the device lengths
            is_decode_only=False,
        )
        with forward_context(md):
            self.model(ids, positions)

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < self.depth

    @torch.inference_mode()
    def launch(self, token_ids: list[int], start: int, block_table: list[int]) -> None:
        """Enqueue the chunk token_ids (positions start.., at most `chunk` tokens) of a
        sequence whose KV slots are block_table's. A shorter chunk (a prompt's last but one)
        is padded at its end: padding positions past the table write the scratch block, and
        those inside its last block write slots that the real tokens there overwrite before
        anyone reads them (attention is causal); the caller keeps start + chunk inside the
        table."""
        num, c = len(token_ids), self.chunk
        assert self.has_room and 0 < num <= c
        host = self.staging[self.num_launched % self.depth]
        self.num_launched += 1
        row = host.numpy()
        row[:num] = token_ids
        row[num:c] = 0
        row[c] = start
        row[c + 1 : c + 1 + len(block_table)] = block_table
        row[c + 1 + len(block_table) :] = self.scratch_block
        if self.graph is None:  # eager, at once
            self.inputs.copy_(host)
            self._run()
            self.in_flight.append(None)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.inputs.copy_(host, non_blocking=True)
            self.graph.replay()
            event = torch.cuda.Event()
            event.record()
        self.in_flight.append(event)

    def poll(self) -> int:
        """How many of the oldest chunks finished since the last poll (no wait)."""
        done = 0
        while self.in_flight and (self.in_flight[0] is None or self.in_flight[0].query()):
            self.in_flight.popleft()
            done += 1
        return done


# Weights from which a model's decode step is bandwidth-bound enough to give the lane more SMs.
LARGE_MODEL_BYTES = 4 << 30
# The device copy rate (bytes read + written a second) that the large models' 3/8 is tuned for
# (an H100 80GB HBM3's); a faster memory gets more SMs.
H100_COPY_BYTES_PER_S = 3.0e12


def default_reserve_sms(
    num_sms: int, weight_bytes: int, copy_bytes_per_s: float | None = None
) -> int:
    """SMs left to the decode steps while the lane runs: half under LARGE_MODEL_BYTES of
    weights, 3/8 from there at H100_COPY_BYTES_PER_S, more with a faster memory, up to half.
    A small model's decode step is hundreds of short kernels, and they need SMs. A large one
    streams its weights, which fewer SMs still pull at most of the memory's rate, while its
    prefill's time grows as 1 / its SMs. A faster memory shortens the decode step but not what
    each kept SM pulls. The counts balance ITL p99 against TTFT in `bench.py prefix`'s
    long-context row (BENCHMARKS.md, long context); on an 8B model none meets the 1.3x TTFT
    target: ITL passes 2x first."""
    if weight_bytes < LARGE_MODEL_BYTES:
        return num_sms // 2
    scale = max(1.0, (copy_bytes_per_s or 0.0) / H100_COPY_BYTES_PER_S)
    return min(num_sms // 2, math.ceil(num_sms * 3 / 8 * scale))


def copy_bytes_per_s(device: torch.device) -> float:
    """The device-to-device copy rate, timed once at start-up (ten 256 MiB copies, past L2)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3)


# The lane's default chunk (config.prefill_lane_tokens): a 32k prompt's TTFT 7% shorter than
# with 2048-token chunks on an 8B model, ITL p99 alike.
LANE_TOKENS = 4096


def build_lane(model, config, max_blocks_per_seq: int, num_kv_blocks: int) -> PrefillLane | None:
    """The runner's lane, or None: not with an MTP head (the lane runs no MTP layer); by
    default only where it runs beside the steps (a GPU with graphs and green contexts). Set
    explicitly without them, its chunks run eagerly in the step loop."""
    device = torch.device(config.device)
    explicit, chunk = config.prefill_lane_tokens is not None, config.prefill_lane_tokens
    graphs = device.type == "cuda" and not config.enforce_eager
    if model.mtp is not None or chunk == 0 or (not explicit and not graphs):
        return None
    chunk = chunk or LANE_TOKENS
    # The lane takes prompts longer than a chunk and a step's budget, within the positions a
    # block table holds; where none can be, there is no lane (its capture's positions would
    # not fit the table or the rotary cache either).
    if max_blocks_per_seq * config.block_size <= max(chunk, config.max_num_batched_tokens):
        return None
    stream = None
    if graphs:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        reserve = config.prefill_lane_reserve_sms
        if not reserve:
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            rate = copy_bytes_per_s(device) if weights >= LARGE_MODEL_BYTES else None
            reserve = default_reserve_sms(sms, weights, rate)
        if reserve >= sms:
            raise ValueError(f"prefill_lane_reserve_sms={reserve}: the GPU has {sms} SMs")
        stream = lane_stream(reserve, device.index or 0)
        if stream is None and not explicit:
            return None  # no green contexts: eager chunks would stall the steps
    return PrefillLane(
        model,
        chunk,
        max_blocks_per_seq,
        config.block_size,
        num_kv_blocks,
        stream,
        reserve_sms=reserve if stream is not None else 0,
    )
