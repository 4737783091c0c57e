"""Per-sequence state: token ids, KV progress and lifecycle.

A sequence owns `token_ids` (prompt + output) and a `block_table`. `num_kv_computed` counts the
leading tokens whose KV is written; the scheduler moves it forward by whatever it schedules, so a
prefill chunk, a decode step and a recompute after preemption are the same operation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tinyserve.sampling_params import SamplingParams

# A token sampled by the step in flight, not read back yet (the overlapped step loop): the next
# step takes its value from the device, the engine fills it in when the results arrive.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # position among the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved: never None, never past max_model_len
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_kv_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    kv_token_limit: int = 0  # KV slots owned: up to the end of the scheduled chunk, no more
    num_cached_tokens: int = 0  # prompt tokens served by the prefix trie at first admission
    num_committed_blocks: int = 0  # leading blocks already inserted into the prefix trie
    trie_node: int | None = None  # last committed block in the prefix trie (insert cursor)
    cache_salt: str | None = None  # isolates tenants: part of the first block's key
    mm_spans: tuple[tuple[int, int, str], ...] = ()  # (start, end, content hash) of media
    # Speculative decoding: drafts proposed for the positions after the last token (scheduled
    # with it next step, never part of token_ids until verified), and acceptance counts.
    draft_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pending_row: int | None = None  # the in-flight step's sampling sequence of its PLACEHOLDER
    # Overlapped speculative loop: drafts of the step in flight, whose acceptance (unknown on
    # the host until it finishes) moves the next step's positions by up to this many.
    num_unverified: int = 0
    num_preemptions: int = 0
    lane_tokens: int = 0  # prompt tokens of its chunks in flight on the prefill lane
    # Hybrid prefix caching: block ends where its prompt branches from others, ascending (a
    # chunk ends at each, so its state is checkpointed there for everyone sharing the prefix).
    branch_points: tuple[int, ...] = ()
    last_scheduled_step: int = 0  # for aging: long prefills are not starved forever
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def __post_init__(self) -> None:
        assert 0 < self.num_prompt_tokens <= len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not written yet: 1 when decoding, more while (re)prefilling."""
        return len(self.token_ids) - self.num_kv_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
