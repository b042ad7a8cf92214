"""Precompute stage: dump target hidden states into safetensors shards."""
import inference_eval.engine  # noqa: E402,F401  (first: OpenBLAS settings, before torch loads numpy)
