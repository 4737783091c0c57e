"""One HTTP generation request in flight: its engine requests, their deltas, its bookkeeping.

A request with P prompts is P engine requests (ids `{rid}-{k}` when P > 1), each pumped by a task
into one queue, so the handler reads one stream of (prompt index, delta). `close()` cancels the
pumps, which aborts every engine request still running (AsyncEngine.generate's rule): a client
that goes away frees its KV blocks at the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams
from tinyserve.serve.metrics import SeqTimes
from tinyserve.serve.responses import usage

if TYPE_CHECKING:
    from tinyserve.serve.server import ServerState


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
        self._num_open = num
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
        while self._num_open:
            k, item = await self._queue.get()
            if item is None:
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                self._num_open -= 1
                raise item
            self._account(k, item)
            return k, item
        return None

    def _account(self, k: int, delta: RequestOutput) -> None:
        m = self.st.metrics
        if not self.started[k]:
            self.started[k] = True
            self.st.num_waiting -= 1
        m.on_output(self.times[k], sum(len(o.token_ids) for o in delta.outputs))
        self.num_cached[k] = delta.num_cached_tokens
        self.aborted |= any(o.finish_reason == "abort" for o in delta.outputs)
        if delta.finished:
            m.on_finish(self.times[k], self.prompt_lens[k], delta.num_cached_tokens)

    def usage(self, num_completion_tokens: int) -> dict:
        return usage(sum(self.prompt_lens), num_completion_tokens, sum(self.num_cached))

    def abort(self) -> None:
        for engine_id in self.engine_ids:
            self.st.engine.abort(engine_id)

    def _expire(self) -> None:
        self.timed_out = True
        self.abort()

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
