"""One HTTP generation request in flight: its engine requests, their deltas, its bookkeeping.

A request with P prompts is P engine requests (ids `{rid}-{k}` when P > 1), each pumped by a task
into one queue, so the handler reads one stream of (prompt index, delta). `close()` cancels the
pumps, which aborts every engine request still running (AsyncEngine.generate's rule): a client
that goes away frees its KV blocks at the next engine step.

`end()` (the request deadline, the drain's) ends the flight at once, without waiting for the
engine's step: each choice still open gets a final delta with finish_reason "abort", queued
behind the deltas already there, and the engine frees the requests at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from tinyserve.outputs import CompletionOutput, RequestOutput
from tinyserve.sampling_params import SamplingParams
from tinyserve.serve.metrics import SeqTimes
from tinyserve.serve.responses import usage

if TYPE_CHECKING:
    from tinyserve.serve.state import ServerState

_END = object()  # queued by `end()`: the prompt's stream ends here with finish_reason "abort"


class Flight:
    def __init__(
        self,
        st: ServerState,
        rid: str,
        prompt_ids: list[list[int]],
        params: list[SamplingParams],
        deadline: float | None,  # loop time; at the deadline every engine request is aborted
        cache_salt: str | None = None,
    ) -> None:
        num = len(prompt_ids)
        self.st = st
        self.cache_salt = cache_salt
        self.engine_ids = [rid] if num == 1 else [f"{rid}-{k}" for k in range(num)]
        self.prompt_lens = [len(ids) for ids in prompt_ids]
        self.num_cached = [0] * num
        self.times = [SeqTimes() for _ in range(num)]
        self.started = [False] * num  # got its first delta: no longer counts as waiting
        self.timed_out = False
        self.aborted = False  # some choice ended with finish_reason "abort"
        self._queue: asyncio.Queue = asyncio.Queue()
        self._is_open = [True] * num  # prompt k's stream has not ended (its pump's rest is dropped)
        self._open_choices = [set(range(p.n)) for p in params]  # without a finish_reason yet
        st.flights.add(self)
        st.num_waiting += num
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._pump(k, ids, p))
            for k, (ids, p) in enumerate(zip(prompt_ids, params))
        ]
        self._timer = loop.call_at(deadline, self._expire) if deadline is not None else None

    @property
    def num_prompts(self) -> int:
        return len(self.engine_ids)

    async def _pump(self, k: int, ids: list[int], params: SamplingParams) -> None:
        gen = self.st.engine.generate(self.engine_ids[k], ids, params, self.cache_salt)
        try:
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    self._queue.put_nowait((k, delta))
        except Exception as e:  # InvalidParameter at admission, EngineDeadError later
            self._queue.put_nowait((k, e))
        else:
            self._queue.put_nowait((k, None))

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, delta); None when every engine request has finished."""
        while any(self._is_open):
            k, item = await self._queue.get()
            if not self._is_open[k]:
                continue  # what the pump still sent after `end()` closed this prompt
            if item is _END:
                item = self._abort_delta(k)
            if item is None or isinstance(item, BaseException) or item.finished:
                self._is_open[k] = False
            if item is None:
                continue
            if isinstance(item, BaseException):
                raise item
            self._account(k, item)
            return k, item
        return None

    def _abort_delta(self, k: int) -> RequestOutput:
        choices = sorted(self._open_choices[k])
        outputs = [CompletionOutput(i, finish_reason="abort") for i in choices]
        return RequestOutput(self.engine_ids[k], None, [], outputs, True, self.num_cached[k])

    def _account(self, k: int, delta: RequestOutput) -> None:
        m = self.st.metrics
        if not self.started[k]:
            self.started[k] = True
            self.st.num_waiting -= 1
        m.on_output(self.times[k], sum(len(o.token_ids) for o in delta.outputs))
        self.num_cached[k] = delta.num_cached_tokens
        for o in delta.outputs:
            if o.finish_reason is not None:
                self._open_choices[k].discard(o.index)
                self.aborted |= o.finish_reason == "abort"
        if delta.finished:
            m.on_finish(self.times[k], self.prompt_lens[k], delta.num_cached_tokens)

    def usage(self, num_completion_tokens: int) -> dict:
        return usage(sum(self.prompt_lens), num_completion_tokens, sum(self.num_cached))

    def abort(self) -> None:
        for engine_id in self.engine_ids:
            self.st.engine.abort(engine_id)

    def end(self) -> None:
        """End every prompt still open now with finish_reason "abort" (see the module)."""
        self.abort()
        for k, is_open in enumerate(self._is_open):
            if is_open:
                self._queue.put_nowait((k, _END))

    def _expire(self) -> None:
        self.timed_out = True
        self.end()

    async def close(self, outcome: str | None) -> None:
        # Bookkeeping first, without awaiting: the handler may be cancelled at any await here
        # (a client that closes the connection right after the last chunk).
        if self._timer is not None:
            self._timer.cancel()
        for task in self._tasks:
            task.cancel()  # a pump still running aborts its engine request as it unwinds
        self.st.num_waiting -= self.started.count(False)
        self.started = [True] * len(self.started)
        self.st.flights.discard(self)
        if outcome is not None:
            self.st.metrics.count(outcome)
        await asyncio.gather(*self._tasks, return_exceptions=True)
