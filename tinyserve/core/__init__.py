"""Policy without CUDA: sequences, the KV block pool, the prefix trie and the scheduler
(which hands the runner a `ScheduledBatch`). Imports nothing above it; unit-tested on the CPU
with fakes."""
