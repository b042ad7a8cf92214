"""The inference engine: one target implementation (`model/`), paged KV cache, page allocator,
scheduler, attention backends (`attention/`), pure batched sampling, and the speculative
decoding schemes (`speculative/`). It imports nothing from heads, precompute, train or the
evaluation: drafters reach it through one interface."""
