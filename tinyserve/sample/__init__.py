"""Sampling on the device: the batched sampler (temperature, top-k/p, min-p, penalties, seeded
counter RNG) and the pinned host-to-device copies that the sampler and the runner share."""
