"""The inference engine: paged KV cache, scheduler, attention backends, sampling, and (later)
speculative decoding with acceptance reports."""
