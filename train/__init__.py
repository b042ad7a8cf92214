"""Training stage: fit draft heads on precomputed shards, from one process to torchrun."""
