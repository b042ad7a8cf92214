"""FlashInfer attention over the paged KV cache (CUDA). Being written; see helper."""
from __future__ import annotations

import importlib.util


def available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
