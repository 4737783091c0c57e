"""The runner: a scheduled batch -> device inputs -> forward (eager or a CUDA graph) -> sampling,
enqueued without a host sync; the MTP drafting forward, warm-up, the prefill lane. No policy."""
