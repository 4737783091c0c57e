"""The step loop and request lifecycle: `LLMEngine` (synchronous) and `AsyncEngine` (steps in a
worker thread, per-request asyncio queues). Owns the scheduler and the runner."""
