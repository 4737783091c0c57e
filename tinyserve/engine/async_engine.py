"""Asyncio face of the engine, for the server: `async for out in engine.generate(...)`.

One background task drives `LLMEngine.step()` in a single worker thread, so model work never
blocks the event loop (torch releases the GIL in its kernels). Each request has an asyncio.Queue
of deltas. Leaving the `async for` early (client gone, task cancelled) aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from tinyserve.config import EngineConfig
from tinyserve.engine.llm_engine import LLMEngine
from tinyserve.outputs import RequestOutput
from tinyserve.sample.grammar import Grammar
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams


class EngineDeadError(RuntimeError):
    """The step loop raised: the engine cannot serve any more requests."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tinyserve-step")
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def is_running(self) -> bool:
        return self.error is None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        grammar: Grammar | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one delta per engine step that moved this request; the last has finished=True.

        Invalid input raises InvalidParameter before anything is queued. `cache_salt` keeps the
        request's prefix-cache blocks apart from other salts (tenants). `grammar`: see
        `compile_grammar`; without it, `params.structured_outputs` is compiled here first.
        """
        if self.error is not None:
            raise EngineDeadError("the engine stopped after an error") from self.error
        if params is not None and params.structured_outputs is not None and grammar is None:
            grammar = await self.compile_grammar(params.structured_outputs)
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.engine.add_request(
                request_id, prompt, params, cache_salt=cache_salt, grammar=grammar
            )
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError("the engine stopped after an error") from out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """`LLMEngine.compile_grammar` in the loop's default executor, not the step thread: a
        schema's compile (up to ~100 ms, without the GIL) holds up neither the loop nor steps.
        Raises InvalidParameter for an invalid schema, regex or grammar."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.compile_grammar, spec)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                deltas = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # fatal: fail every waiting stream, refuse new ones
                self.error = e
                for q in self._queues.values():
                    q.put_nowait(e)
                return
            for d in deltas:
                q = self._queues.get(d.request_id)
                if q is not None:
                    q.put_nowait(d)
