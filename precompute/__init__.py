"""Precompute stage: dump target hidden states into safetensors shards."""
