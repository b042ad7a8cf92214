"""Training stage: fit draft heads on precomputed shards, from one process to torchrun."""
import inference_eval.engine  # noqa: E402,F401  (first: OpenBLAS settings, before torch loads numpy)
